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
  std::vector<StreamId> stream_uses;  // streams other than `stream` that used the block

  void* ptr() const { return reinterpret_cast<void*>(addr); }
  bool is_free() const { return !allocated && pending_events == 0; }
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

// Free blocks ordered by (stream, size, address): best fit is one lower_bound.
struct BlockOrder {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->addr < b->addr;
  }
};
using BlockSet = std::set<Block*, BlockOrder>;

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
  BlockSet small_blocks;
  BlockSet large_blocks;
  int use_count = 0;   // private pools: holders (graphs, MemPools); 0 means its cache may go
  int segments = 0;

  BlockSet& blocks_for(bool small) { return small ? small_blocks : large_blocks; }
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
