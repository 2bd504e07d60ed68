// Where Block objects come from (core/block_arena.h): growing the arena, and counting what it made and keeps spare.
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

std::size_t BlockArena::made() const { return chunks_.size() * kArenaChunk; }

std::size_t BlockArena::spares() const {
  std::size_t count = 0;
  for (const Block* b = spare_; b; b = b->next) ++count;
  return count;
}

}  // namespace gpumem
