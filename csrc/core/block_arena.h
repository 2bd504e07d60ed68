// Where Block objects come from.
#pragma once

#include <memory>
#include <vector>

#include "core/block.h"

namespace gpumem {

// Recycles Block objects: splits and merges happen on every cached allocation, and going to the
// heap for each would cost more than the rest of the path.
//
// Spare blocks are in the free state: not allocated, nothing requested, no pending events, no
// stream uses (a free block always is; its vector keeps its capacity for the next user). They are
// linked through `next`. Everything else about a block (address, size, stream, segment, neighbours,
// mapped) is set by whoever makes it.
class BlockArena {
 public:
  Block* make() {
    keep_one();
    Block* block = spare_;
    spare_ = block->next;
    return block;
  }
  // Makes sure the next make() allocates nothing (so cannot throw): for a caller that must not
  // fail once it has begun to change things.
  void keep_one() {
    if (!spare_) grow();
  }
  // `block` must be in the free state.
  void recycle(Block* block) {
    block->chain_spare(spare_);
    spare_ = block;
  }
  // For the invariant checker: every Block it made, and those spare now. The others are in
  // segments: made() == spares() + the blocks of the segments whose blocks it makes.
  std::size_t made() const;
  std::size_t spares() const;

 private:
  void grow();

  std::vector<std::unique_ptr<Block[]>> chunks_;
  Block* spare_ = nullptr;
};

}  // namespace gpumem
