#include "core/block_pool.h"

#include <algorithm>

namespace gpumem {

namespace {
constexpr std::size_t kArenaChunk = 256;
}  // namespace

Block* BlockArena::make() {
  if (spare_.empty()) {
    chunks_.emplace_back(new Block[kArenaChunk]);
    Block* chunk = chunks_.back().get();
    for (std::size_t i = kArenaChunk; i-- > 0;) spare_.push_back(&chunk[i]);
  }
  Block* block = spare_.back();
  spare_.pop_back();
  return block;
}

void BlockArena::recycle(Block* block) {
  block->stream_uses.clear();
  std::vector<StreamId> keep = std::move(block->stream_uses);
  *block = Block{};
  block->stream_uses = std::move(keep);  // keeps the vector's capacity for the next user
  spare_.push_back(block);
}

namespace {
FreeKey key_of(Block* block) { return FreeKey{block->stream, block->size, block->addr, block}; }
}  // namespace

void FreeBlocks::insert(Block* block) {
  if (spare_.empty()) {
    block->where = set_.insert(key_of(block)).first;
    return;
  }
  BlockSet::node_type node = std::move(spare_.back());
  spare_.pop_back();
  node.value() = key_of(block);
  block->where = set_.insert(std::move(node)).position;
}

void FreeBlocks::erase(Block* block) { spare_.push_back(set_.extract(block->where)); }

Block* FreeBlocks::take_best_fit(StreamId stream, std::size_t size) {
  auto it = set_.lower_bound(FreeKey{stream, size, 0, nullptr});
  if (it == set_.end() || it->stream != stream) return nullptr;
  Block* block = it->block;
  spare_.push_back(set_.extract(it));
  return block;
}

bool FreeBlocks::contains(const Block* block) const {
  auto it = set_.find(FreeKey{block->stream, block->size, block->addr, nullptr});
  return it != set_.end() && it->block == block;
}

Block* split_block(Block* block, std::size_t size, BlockArena& arena) {
  Block* rest = arena.make();
  rest->addr = block->addr + size;
  rest->size = block->size - size;
  rest->stream = block->stream;
  rest->segment = block->segment;
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
  Merge merge{block, {0, 0}, 0};
  if (Block* next = block->next; next && next->is_free()) {
    merge.absorbed[merge.absorbed_count++] = next->size;
    blocks.erase(next);
    absorb(block, next, arena);
  }
  if (Block* prev = block->prev; prev && prev->is_free()) {
    merge.absorbed[merge.absorbed_count++] = prev->size;
    blocks.erase(prev);
    absorb(prev, block, arena);
    merge.block = prev;
  }
  return merge;
}

std::size_t largest_free_block(const Pool& pool) {
  std::size_t largest = 0;
  for (const FreeBlocks* set : {&pool.small_blocks, &pool.large_blocks}) {
    set->for_each([&](const Block* b) { largest = std::max(largest, b->size); });
  }
  return largest;
}

}  // namespace gpumem
