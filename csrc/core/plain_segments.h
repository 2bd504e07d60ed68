// Plain segments: each one range from its pool's SegmentSource (core/segment_source.h), cut into
// blocks, and given back whole once it is one free block again. Every pool uses them; the default
// pool uses growable segments instead where the backend can map pages (core/growable_segments.h).
#pragma once

#include <cstddef>
#include <vector>

#include "core/departures.h"
#include "core/memory_source.h"

namespace gpumem {

class PlainSegments final : public MemorySource {
 public:
  explicit PlainSegments(DeviceState& d) : d_(d) {}

  // A segment of the normal size for the request (core/sizing.h), else the smallest that holds it.
  Block* grow(Request& r) override;
  std::size_t growth_for(std::size_t size) const override;
  std::size_t release(std::size_t bytes, ReleaseOrder order) override;
  void drop_empty() override {}
  bool frees_memory(const Block& merged) const override { return merged.segment->is_unused(); }
  void drop(const Segment& segment) noexcept override;

  // Gives one unused segment back to its source. The source first: if it throws, the segment is
  // still cached and everything is as before. While deferring (below), a segment of the backend's
  // instead leaves the tables and the statistics for `out`, its bytes still in the cap and counted
  // as departing (core/departures.h); the caller gives it back after letting go of the device.
  void release_segment(Segment* segment);
  // Defers the backend's segments that releases give back to `out` from now on; nullptr ends it.
  void defer_to(std::vector<Departure>* out) { deferred_ = out; }
  // The unused segments of releasable pools, in address order.
  std::vector<Segment*> unused() const;

 private:
  Block* reserve(Request& r, std::size_t bytes);

  DeviceState& d_;
  std::vector<Departure>* deferred_ = nullptr;
};

}  // namespace gpumem
