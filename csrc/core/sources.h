// The two sources of one device's new memory (core/memory_source.h), and which of them serves a
// pool and which a segment came from: growable segments serve the default pool where the backend
// maps pages and they are asked for, plain segments everything else.
#pragma once

#include "core/growable_segments.h"
#include "core/plain_segments.h"

namespace gpumem {

struct Sources {
  Sources(DeviceState& d, bool growable, std::size_t large_chunk) : plain(d), growable(d, plain, growable, large_chunk) {}

  MemorySource& serving(const Pool& pool) {
    return growable.serves(pool) ? static_cast<MemorySource&>(growable) : plain;
  }
  MemorySource& of(const Segment& segment) {
    return segment.growable ? static_cast<MemorySource&>(growable) : plain;
  }

  PlainSegments plain;
  GrowableSegments growable;
};

}  // namespace gpumem
