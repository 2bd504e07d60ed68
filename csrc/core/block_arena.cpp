#include "core/block_arena.h"

namespace gpumem {

namespace {
constexpr std::size_t kArenaChunk = 256;
}  // namespace

// Out of line: it runs once per 256 blocks.
void BlockArena::grow() {
  chunks_.emplace_back(new Block[kArenaChunk]);
  Block* chunk = chunks_.back().get();
  for (std::size_t i = kArenaChunk; i-- > 0;) recycle(&chunk[i]);
}

}  // namespace gpumem
