// Which cached segments to give back when memory is needed.
#pragma once

#include <cstddef>
#include <vector>

#include "core/block.h"

namespace gpumem {

// From `candidates` (unused cached segments), those to release to free at least `bytes`: the
// smallest single segment that covers it, so one release spares the rest of the cache; otherwise
// the oldest first until covered; all of them if even that is not enough.
std::vector<Segment*> choose_for_bytes(std::vector<Segment*> candidates, std::size_t bytes);

// Oldest first: the order in which the release threshold and a lowered limit give segments back.
void sort_oldest_first(std::vector<Segment*>& segments);

}  // namespace gpumem
