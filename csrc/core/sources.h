// The two sources of one device's new memory (core/memory_source.h), and which of them serves a
// pool and which a segment came from: growable segments serve the default pool where the backend
// maps pages and they are asked for, plain segments everything else.
#pragma once

#include "core/growable_segments.h"
#include "core/plain_segments.h"

namespace gpumem {

struct Sources {
  Sources(DeviceState& d, bool growable) : plain(d), growable(d, plain, growable) {}

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
