// Split and merge: cutting a block in two inside its segment, and folding a freed block into its
// free neighbours. They keep the segment's block list and the free set consistent; statistics are
// the caller's (DeviceAllocator), told once per path through the StatLedger's events.
#pragma once

#include <cstddef>

#include "core/block_arena.h"
#include "core/free_set.h"

namespace gpumem {

// Cuts `block` (not in any set) after `size` bytes; `block` keeps the front, the returned block
// is the rest, linked after it in the segment.
Block* split_block(Block* block, std::size_t size, BlockArena& arena);

// Merges `block` (free, not in any set) with its free neighbours of the same state (mapped or not),
// taking them out of `blocks`, the set of that state.
struct Merge {
  Block* block;                // the merged block: the lowest of those merged
  int absorbed_count;          // neighbours folded in (each, if mapped, was an inactive split block)
  std::size_t absorbed_bytes;  // their sizes together
};
Merge merge_free_neighbours(Block* block, FreeBlocks& blocks, BlockArena& arena);

}  // namespace gpumem
