// Blocks freed during a CUDA graph capture while other streams used them (record_stream).
//
// Outside capture such a block waits for events recorded on those streams. Events cannot be
// queried while a graph captures, so by default the block waits for the capture to end. With
// capture reuse on, the free leaves a marker in each using stream's captured work
// (Backend::capture_marker); a later request on the block's own stream reuses the block once that
// stream's work follows every marker, i.e. the capture joined those streams back into it
// (Backend::capture_follows). A request on the block's stream is the only one that could take it:
// free blocks are kept per stream. A block some marker could not be made for waits for the end.
#include <algorithm>

#include "core/stream_events.h"

namespace gpumem {

void StreamEvents::defer(Block* block) {
  block->pend(1);  // held until the capture ends or its markers are followed
  Deferred d{block, {}};
  if (capture_reuse_) {
    for (StreamId s : block->stream_uses) {
      const CaptureMarker marker = backend_.capture_marker(device_, s);
      if (marker == 0) {
        d.markers.clear();
        break;
      }
      d.markers.push_back(marker);
    }
  }
  deferred_.push_back(std::move(d));
}

Block* StreamEvents::take_followed(StreamId stream) {
  if (!capture_reuse_) return nullptr;
  const auto followed = [&](const Deferred& d) {
    if (d.markers.empty() || d.block->stream != stream) return false;
    return std::all_of(d.markers.begin(), d.markers.end(),
                       [&](CaptureMarker m) { return backend_.capture_follows(device_, stream, m); });
  };
  const auto it = std::find_if(deferred_.begin(), deferred_.end(), followed);
  if (it == deferred_.end()) return nullptr;
  Block* block = it->block;
  deferred_.erase(it);
  block->forget_stream_uses();
  return block;
}

}  // namespace gpumem
