// Split and merge: cutting a block in two inside its segment, and folding a freed block into its
// free neighbours. They keep the segment's block list and the free set consistent; statistics are
// the caller's (DeviceAllocator), told once per path through the StatLedger's events. Both run on
// every cached allocation or free, so they are inline.
#pragma once

#include <cstddef>

#include "core/block_arena.h"
#include "core/free_set.h"

namespace gpumem {

// What merge_free_neighbours did.
struct Merge {
  Block* block;                // the merged block: the lowest of those merged
  int absorbed_count;          // neighbours folded in (each, if mapped, was an inactive split block)
  std::size_t absorbed_bytes;  // their sizes together
};

// Cuts `block` (not in any set) after `size` bytes; `block` keeps the front, the returned block
// is the rest, linked after it in the segment.
inline Block* split_block(Block* block, std::size_t size, BlockArena& arena) {
  Block* rest = arena.make();
  rest->place(block->segment, block->addr + size, block->size - size, block->stream, block->mapped);
  rest->link_after(block);
  block->resize(size);
  return rest;
}

namespace split_merge_detail {

// Folds the block right after `earlier` into it.
inline void absorb(Block* earlier, BlockArena& arena) {
  arena.recycle(earlier->absorb_next());
}

}  // namespace split_merge_detail

// Whether `neighbour` (next to `block`, or null) is folded into it by merge_free_neighbours: free,
// and of the same state (mapped or not).
inline bool merges_with(const Block* block, const Block* neighbour) {
  return neighbour && neighbour->is_free() && neighbour->mapped == block->mapped;
}

// Whether merge_free_neighbours would fold a neighbour into `block`.
inline bool joins_a_free_neighbour(const Block* block) {
  return merges_with(block, block->next) || merges_with(block, block->prev);
}

// Merges `block` (free, not in any set) with its free neighbours of the same state (mapped or not),
// taking them out of `blocks`, the set of that state.
inline Merge merge_free_neighbours(Block* block, FreeBlocks& blocks, BlockArena& arena) {
  Merge merge{block, 0, 0};
  if (Block* next = block->next; merges_with(block, next)) {
    ++merge.absorbed_count;
    merge.absorbed_bytes += next->size;
    blocks.erase(next);
    split_merge_detail::absorb(block, arena);  // `next`
  }
  if (Block* prev = block->prev; merges_with(block, prev)) {
    ++merge.absorbed_count;
    merge.absorbed_bytes += prev->size;
    blocks.erase(prev);
    split_merge_detail::absorb(prev, arena);  // `block`
    merge.block = prev;
  }
  return merge;
}

}  // namespace gpumem
