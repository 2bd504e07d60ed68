// Where a pool's plain segments come from and go back to.
//
// Every pool gets its segments from the device's backend unless it was created with a source of
// its own: a torch.cuda.MemPool that brings its own allocator (a user's alloc/free functions,
// NCCL's), which the torch adapter wraps as a SegmentSource. The core treats both alike: the cap
// counts the bytes before the source is asked and gives them back if it refuses or throws; the
// statistics count the segment; and the segment goes back to the source it came from (Segment::
// source), whatever releases it (empty_cache, a pool's release, the fallbacks of malloc, the
// allocator's destructor). A pool with its own source uses plain segments only.
#pragma once

#include <cstddef>

#include "core/backend.h"

namespace gpumem {

class SegmentSource {
 public:
  virtual ~SegmentSource() = default;

  // A segment of exactly `bytes` on the allocator's device, or nullptr when the source has no
  // memory for it (the OOM path then runs). Other failures throw.
  virtual void* reserve(std::size_t bytes) = 0;
  // Gives back a segment reserve returned, whole. May throw; the caller changes nothing then.
  virtual void release(void* ptr, std::size_t bytes) = 0;
};

// The default source: one device of the backend.
class BackendSource final : public SegmentSource {
 public:
  BackendSource(Backend& backend, int device) : backend_(backend), device_(device) {}
  void* reserve(std::size_t bytes) override { return backend_.reserve(device_, bytes); }
  void release(void* ptr, std::size_t bytes) override { backend_.release(device_, ptr, bytes); }

 private:
  Backend& backend_;
  const int device_;
};

}  // namespace gpumem
