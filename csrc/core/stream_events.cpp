// The event queue of blocks that other streams used; the deferred blocks are core/capture_reuse.cpp.
#include "core/stream_events.h"

#include <algorithm>

#include "core/errors.h"

namespace gpumem {

StreamEvents::~StreamEvents() {
  for (const PendingFree& p : pending_) quietly([&] { backend_.destroy_event(device_, p.event); });
}

void StreamEvents::wait_for(Block* block) {
  block->pend(static_cast<int>(block->stream_uses.size()));
  for (StreamId s : block->stream_uses) pending_.push_back({block, backend_.record_event(device_, s)});
  block->forget_stream_uses();
}

std::vector<Block*> StreamEvents::take_done() {
  std::vector<Block*> done;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    PendingFree p = pending_[i];
    if (!backend_.event_done(device_, p.event)) {
      pending_[kept++] = p;
      continue;
    }
    backend_.destroy_event(device_, p.event);
    if (p.block->pending_events == 1) {
      done.push_back(p.block);
    } else {
      p.block->event_done();
    }
  }
  pending_.resize(kept);
  return done;
}

void StreamEvents::end_capture() {
  for (const Deferred& d : deferred_) {
    d.block->pend(0);
    wait_for(d.block);
  }
  deferred_.clear();
}

}  // namespace gpumem
