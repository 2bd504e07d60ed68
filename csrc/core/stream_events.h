// Blocks freed while other streams still use them (record_stream): the events that say when those
// streams are done, and, during a capture, the blocks held back until it ends or until the capture
// graph shows their streams joined the block's own (capture reuse, core/capture_reuse.cpp).
//
// Invariant: a waiting block's pending_events = its events queued here + 1 if it is deferred.
// A block keeps its last event until it is taken (take_done), so that a neighbour freed first does
// not merge with it.
#pragma once

#include <cstddef>
#include <deque>
#include <vector>

#include "core/backend.h"
#include "core/block.h"

namespace gpumem {

class StreamEvents {
 public:
  StreamEvents(Backend& backend, int device) : backend_(backend), device_(device) {}
  ~StreamEvents();  // destroys the queued events, quietly: the device may be gone
  StreamEvents(const StreamEvents&) = delete;
  StreamEvents& operator=(const StreamEvents&) = delete;

  bool waiting() const { return !pending_.empty(); }   // an event is queued
  bool deferring() const { return !deferred_.empty(); }  // a block is held for a capture

  // Outside a capture: one event on each stream that used `block`, which waits for all of them.
  void wait_for(Block* block);
  // The blocks whose last event is done, out of the queue, their events destroyed. The queue is
  // settled before the caller frees any (a free may release memory, and a release that throws
  // must not leave done events queued).
  std::vector<Block*> take_done();

  // During a capture: holds `block` until the capture ends, or, with capture reuse on, until its
  // own stream follows a marker left in each stream that used it.
  void defer(Block* block);
  void set_capture_reuse(bool on) { capture_reuse_ = on; }
  // A deferred block of `stream` whose markers that stream's captured work follows, out of the
  // list, or nullptr: one at a time, so that a free that throws leaves the others deferred.
  Block* take_followed(StreamId stream);
  // The capture ended: every deferred block waits for events instead.
  void end_capture();

  // For the checker: calls f(block) once per event queued and once per deferred block.
  template <class F>
  void for_each_wait(F f) const {
    for (const PendingFree& p : pending_) f(p.block);
    for (const Deferred& d : deferred_) f(d.block);
  }

 private:
  struct PendingFree {
    Block* block;
    EventId event;
  };
  struct Deferred {
    Block* block;
    std::vector<CaptureMarker> markers;  // one per stream that used the block; none: only the end frees it
  };

  Backend& backend_;
  const int device_;
  std::deque<PendingFree> pending_;
  std::vector<Deferred> deferred_;
  bool capture_reuse_ = false;
};

}  // namespace gpumem
