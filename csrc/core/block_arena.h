// Where Block objects come from.
#pragma once

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

}  // namespace gpumem
