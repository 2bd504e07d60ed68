// A Backend that reports segment reserves and releases to the History (segment_alloc /
// segment_free trace entries, which torch's memory viewer and trace trackers use), and the pages
// growable segments map and unmap (segment_map / segment_unmap, as torch's expandable segments
// report them), then forwards to the real backend. Address ranges hold no memory and are not
// reported. The core does not know it is watched. Memory is reserved and mapped only on the slow
// path, so the extra virtual call costs nothing that matters.
#pragma once

#include "core/backend.h"
#include "torch/history.h"

namespace gpumem {

class TracingBackend final : public ForwardingBackend {
 public:
  TracingBackend(Backend& inner, History& history) : ForwardingBackend(inner), history_(history) {}

  // The request the calling thread is serving, for the segment entries it causes: its stream and
  // the stack gathered for it (segments remember the stack that made them). The adapter opens one
  // around each call into the core while history is active; closing it drops the stack.
  class Request {
   public:
    Request(StreamId stream, History::Context context);
    ~Request();
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
  };

  // Recorded, then passed on; every other call is passed on as it is (ForwardingBackend).
  void* reserve(int device, std::size_t bytes) override;
  void release(int device, void* ptr, std::size_t bytes) override;
  bool map(int device, void* ptr, std::size_t bytes, std::size_t chunk) override;
  void unmap(int device, void* ptr, std::size_t bytes) override;

 private:
  History& history_;
};

}  // namespace gpumem
