// Blocks, segments and pools.
//
// A segment is one contiguous range obtained from the backend. It is cut into blocks that tile it
// in address order; blocks never span segments, and a segment is returned to the backend only when
// it is one free block again. Each segment belongs to one pool (the default pool, or a private pool
// of a CUDA graph or MemPool) and to one stream: its blocks serve requests on that stream only,
// unless recorded as used by others.
//
// Invariants (checked by DeviceAllocator::check_invariants):
//   - a segment's blocks are contiguous: b->addr + b->size == b->next->addr; sizes sum to its size
//   - the first block of a segment is segment->head, for the segment's whole life
//   - no two neighbouring blocks are both free (merged on free)
//   - a block is in its pool's free set iff it is free (not allocated, no pending stream events),
//     exactly once, in the set of its size class (small or large)
//   - the statistics equal a recomputation from the segments
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <set>
#include <vector>

#include "core/backend.h"

namespace gpumem {

class DeviceAllocator;
struct Segment;
struct Pool;

// Free blocks ordered by (stream, size, address): best fit is one lower_bound. Each tree node
// carries its block's key, so a search compares node memory instead of following Block pointers.
struct Block;
struct FreeKey {
  StreamId stream;
  std::size_t size;
  std::uintptr_t addr;
  Block* block;
  bool operator<(const FreeKey& o) const {
    if (stream != o.stream) return stream < o.stream;
    if (size != o.size) return size < o.size;
    return addr < o.addr;
  }
};
using BlockSet = std::set<FreeKey>;

struct Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;       // bytes the caller asked for; 0 while free
  StreamId stream = 0;             // the segment's stream, copied here for the free-set order
  Segment* segment = nullptr;
  Block* prev = nullptr;           // neighbours in address order within the segment
  Block* next = nullptr;
  bool allocated = false;
  int pending_events = 0;          // freed by the caller, still in use on other streams
  BlockSet::iterator where;        // its place in the free set, valid while it is free
  std::vector<StreamId> stream_uses;  // streams other than `stream` that used the block

  void* ptr() const { return reinterpret_cast<void*>(addr); }
  bool is_free() const { return !allocated && pending_events == 0; }
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

// One size class of a pool's free blocks. Erasing goes through the iterator each block keeps,
// with no second search, and tree nodes are kept for the next insert instead of going back to
// the heap: splits and merges happen on every cached allocation.
class FreeBlocks {
 public:
  void insert(Block* block);
  void erase(Block* block);
  // The smallest free block on `stream` of at least `size` bytes, removed; nullptr if none.
  Block* take_best_fit(StreamId stream, std::size_t size);

  bool contains(const Block* block) const;
  std::size_t size() const { return set_.size(); }
  template <typename F>
  void for_each(F f) const {
    for (const FreeKey& k : set_) f(k.block);
  }

 private:
  BlockSet set_;
  std::vector<BlockSet::node_type> spare_;
};

// {0, 0} is the default pool; others mirror PyTorch's MempoolId_t.
struct PoolId {
  std::uint64_t first = 0;
  std::uint64_t second = 0;
  bool is_default() const { return first == 0 && second == 0; }
  bool operator<(const PoolId& o) const { return first != o.first ? first < o.first : second < o.second; }
  bool operator==(const PoolId& o) const { return first == o.first && second == o.second; }
};

struct Pool {
  PoolId id;
  FreeBlocks small_blocks;
  FreeBlocks large_blocks;
  int use_count = 0;   // private pools: holders (graphs, MemPools); 0 means its cache may go
  int segments = 0;

  FreeBlocks& blocks_for(bool small) { return small ? small_blocks : large_blocks; }
};

struct Segment {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  StreamId stream = 0;
  Pool* pool = nullptr;
  bool small = false;            // small-pool segment
  std::uint64_t serial = 0;      // creation order: lower is older
  Block* head = nullptr;
  DeviceAllocator* owner = nullptr;

  bool is_unused() const { return head->is_free() && head->size == size; }
};

}  // namespace gpumem
