#include "core/block_arena.h"

#include <utility>

namespace gpumem {

namespace {
constexpr std::size_t kArenaChunk = 256;
}  // namespace

void BlockArena::grow() {
  chunks_.emplace_back(new Block[kArenaChunk]);
  Block* chunk = chunks_.back().get();
  for (std::size_t i = kArenaChunk; i-- > 0;) spare_.push_back(&chunk[i]);
}

void BlockArena::recycle(Block* block) {
  block->stream_uses.clear();
  std::vector<StreamId> keep = std::move(block->stream_uses);
  *block = Block{};
  block->stream_uses = std::move(keep);  // keeps the vector's capacity for the next user
  spare_.push_back(block);
}

}  // namespace gpumem
