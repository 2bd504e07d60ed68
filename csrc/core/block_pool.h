// Best fit, split and merge: the operations on blocks inside segments. They keep the block list
// and the free sets consistent; statistics are the caller's (DeviceAllocator), updated once per path.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/block.h"

namespace gpumem {

// Recycles Block objects: splits and merges happen on every cached allocation, and going to the
// heap for each would cost more than the rest of the path.
class BlockArena {
 public:
  Block* make() {
    if (spare_.empty()) grow();
    Block* block = spare_.back();
    spare_.pop_back();
    return block;
  }
  void recycle(Block* block);

 private:
  void grow();

  std::vector<std::unique_ptr<Block[]>> chunks_;
  std::vector<Block*> spare_;
};

// Cuts `block` (not in any set) after `size` bytes; `block` keeps the front, the returned block
// is the rest, linked after it in the segment.
Block* split_block(Block* block, std::size_t size, BlockArena& arena);

// Merges `block` (free, not in any set) with its free neighbours of the same state (mapped or not),
// taking them out of `blocks`, the set of that state.
struct Merge {
  Block* block;                // the merged block: the lowest of those merged
  std::size_t absorbed[2];     // sizes of the neighbours folded in (each, if mapped, was an inactive split block)
  int absorbed_count;
};
Merge merge_free_neighbours(Block* block, FreeBlocks& blocks, BlockArena& arena);

// The largest free block in `pool`, 0 if none.
std::size_t largest_free_block(const Pool& pool);

}  // namespace gpumem
