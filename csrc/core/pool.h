// Pools: the default pool and the private pools of CUDA graphs and MemPools. A pool owns its free
// sets (core/free_set.h) and its options; its segments are the device allocator's.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/free_set.h"
#include "core/segment_source.h"

namespace gpumem {

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
  // Options (MemPool's), beside the id: place() reads no_split when it splits, and the adapter
  // reads the id on every allocation, so both sit on a cache line already loaded.
  bool no_split = false;    // blocks are never split: each of its segments is one block
  bool use_on_oom = false;  // while held, its cached free blocks may serve default-pool requests on OOM
  FreeBlocks small_blocks;
  FreeBlocks large_blocks;
  FreeBlocks unmapped_small;   // unmapped blocks of growable segments, by the segment's size class
  FreeBlocks unmapped_large;
  int use_count = 0;   // private pools: holders (graphs, MemPools); 0 means its cache may go
  int segments = 0;
  // Where its segments come from when not the device's backend (see core/segment_source.h). Set
  // when the pool is created and never changed; the pool outlives its segments, so the source
  // stays alive while any segment of it does.
  std::shared_ptr<SegmentSource> source;

  FreeBlocks& blocks_for(bool small) { return small ? small_blocks : large_blocks; }
  FreeBlocks& unmapped_for(bool small) { return small ? unmapped_small : unmapped_large; }
  const FreeBlocks& blocks_for(bool small) const { return small ? small_blocks : large_blocks; }
  const FreeBlocks& unmapped_for(bool small) const { return small ? unmapped_small : unmapped_large; }
};

// The largest free block in `pool`, 0 if none.
inline std::size_t largest_free_block(const Pool& pool) {
  std::size_t largest = 0;
  for (const FreeBlocks* set : {&pool.small_blocks, &pool.large_blocks}) {
    set->for_each([&](const Block* b) { largest = std::max(largest, b->size); });
  }
  return largest;
}

}  // namespace gpumem
