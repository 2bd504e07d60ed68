#include "core/split_merge.h"

namespace gpumem {

Block* split_block(Block* block, std::size_t size, BlockArena& arena) {
  Block* rest = arena.make();
  rest->addr = block->addr + size;
  rest->size = block->size - size;
  rest->stream = block->stream;
  rest->segment = block->segment;
  rest->mapped = block->mapped;
  rest->prev = block;
  rest->next = block->next;
  if (rest->next) rest->next->prev = rest;
  block->next = rest;
  block->size = size;
  return rest;
}

namespace {

// Folds `later` (the block right after `earlier`) into `earlier`.
void absorb(Block* earlier, Block* later, BlockArena& arena) {
  earlier->size += later->size;
  earlier->next = later->next;
  if (earlier->next) earlier->next->prev = earlier;
  arena.recycle(later);
}

}  // namespace

Merge merge_free_neighbours(Block* block, FreeBlocks& blocks, BlockArena& arena) {
  Merge merge{block, 0, 0};
  if (Block* next = block->next; next && next->is_free() && next->mapped == block->mapped) {
    ++merge.absorbed_count;
    merge.absorbed_bytes += next->size;
    blocks.erase(next);
    absorb(block, next, arena);
  }
  if (Block* prev = block->prev; prev && prev->is_free() && prev->mapped == block->mapped) {
    ++merge.absorbed_count;
    merge.absorbed_bytes += prev->size;
    blocks.erase(prev);
    absorb(prev, block, arena);
    merge.block = prev;
  }
  return merge;
}

}  // namespace gpumem
