// Where a pool's new memory comes from, and how its cached memory goes back.
//
// Two sources, each owning its state:
//   - PlainSegments (core/plain_segments.h): each segment one range from the pool's
//     SegmentSource (the backend, or a MemPool's allocator), given back whole when it is one free
//     block;
//   - GrowableSegments (core/growable_segments.h): an address range per stream and size class of
//     the default pool, mapped page by page as blocks need it, its free pages unmapped.
// The fallback chain asks a pool's source for new memory and asks both, plain first, to give memory
// back; it never looks inside either.
#pragma once

#include <cstddef>

#include "core/device_state.h"

namespace gpumem {

// How a release chooses what goes: oldest first (a lowered limit, the release threshold,
// empty_cache), or for a request (the fewest releases that cover it: core/release_policy.h, and
// the largest free pages first).
enum class ReleaseOrder { kOldest, kForRequest };

class MemorySource {
 public:
  virtual ~MemorySource() = default;

  // New memory for the request within the cap: a free block of at least r.size bytes, in no free
  // set and not counted as inactive; nullptr if the cap or the device refused (noted on `r`).
  virtual Block* grow(Request& r) = 0;
  // The bytes new memory for a request of `size` bytes adds to reserved.
  virtual std::size_t growth_for(std::size_t size) const = 0;
  // Gives back cached memory of releasable pools until `bytes` went back or none is left; returns
  // the bytes given back.
  virtual std::size_t release(std::size_t bytes, ReleaseOrder order) = 0;
  // At empty_cache, after release: drops what holds no memory but still holds something else (the
  // address ranges of growable segments with no page mapped).
  virtual void drop_empty() = 0;
  // Whether `merged`, a block just freed and merged, made memory releasable.
  virtual bool frees_memory(const Block& merged) const = 0;
  // Gives back all of `segment`, live blocks included, without throwing: for the allocator's
  // destructor, which forgets the segments itself.
  virtual void drop(const Segment& segment) noexcept = 0;
};

}  // namespace gpumem
