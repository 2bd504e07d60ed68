// Pools: the default pool and the private pools of CUDA graphs and MemPools. A pool owns its free
// sets (core/free_set.h) and its options; its segments are the device allocator's.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <utility>

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

// A private pool's options (MemPool's). kNoSplit: its blocks are never split (it can only be
// turned on: blocks already split would break it). kUseOnOom: while held, its cached free blocks
// may serve a default-pool request that could not get new memory.
enum class PoolOption { kNoSplit, kUseOnOom };

// Its id and source are fixed at creation; its options, holders and segment count change only
// through its methods, by PrivatePools (holders), the device's set_pool_option (options) and the
// SegmentTable (segments, as it files and erases them). Its free sets change through their own.
class Pool {
 public:
  Pool() = default;  // the default pool: id {0, 0}, segments from the device's backend
  Pool(PoolId id, std::shared_ptr<SegmentSource> source) : id_(id), source_(std::move(source)) {}
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  PoolId id() const { return id_; }
  // Where its segments come from when not the device's backend (see core/segment_source.h), else
  // nullptr. The pool outlives its segments, so the source stays alive while any segment of it does.
  SegmentSource* source() const { return source_.get(); }

  bool no_split() const { return no_split_; }
  bool use_on_oom() const { return use_on_oom_; }
  // A region's pool (gpumem.region): growable segments whatever the process's default, so that its
  // memory can be paused and resumed at the same addresses (core/pause.cpp). Set once, at creation.
  bool region() const { return region_; }
  void make_region() { region_ = true; }
  // Paused: its chunks are unmapped (core/pause.cpp); it serves no request and gives nothing back
  // until resumed.
  bool paused() const { return paused_; }
  void set_paused(bool paused) { paused_ = paused; }
  // Throws std::invalid_argument, changing nothing, for turning no_split off.
  void set_option(PoolOption option, bool on) {
    if (option == PoolOption::kUseOnOom) {
      use_on_oom_ = on;
    } else if (on) {
      no_split_ = true;
    } else {
      throw std::invalid_argument("gpumem: a pool's no_split can only be turned on (its blocks may be split already)");
    }
  }

  // Private pools' holders (graphs, MemPools); 0 means its cache may go.
  int use_count() const { return use_count_; }
  void add_holder() { ++use_count_; }
  // Drops a holder; true if that left the pool unheld, false if nobody held it.
  bool drop_holder() { return use_count_ > 0 && --use_count_ == 0; }

  int segments() const { return segments_; }
  void segment_filed() { ++segments_; }
  void segment_erased() { --segments_; }

  FreeBlocks& blocks_for(bool small) { return small ? small_blocks_ : large_blocks_; }
  FreeBlocks& unmapped_for(bool small) { return small ? unmapped_small_ : unmapped_large_; }
  const FreeBlocks& blocks_for(bool small) const { return small ? small_blocks_ : large_blocks_; }
  const FreeBlocks& unmapped_for(bool small) const { return small ? unmapped_small_ : unmapped_large_; }

 private:
  const PoolId id_{};
  // Options beside the id: place() reads no_split when it splits, and the adapter reads the id on
  // every allocation, so both sit on a cache line already loaded.
  bool no_split_ = false;    // blocks are never split: each of its segments is one block
  bool use_on_oom_ = false;  // while held, its cached free blocks may serve default-pool requests on OOM
  bool region_ = false;
  bool paused_ = false;
  FreeBlocks small_blocks_;
  FreeBlocks large_blocks_;
  FreeBlocks unmapped_small_;  // unmapped blocks of growable segments, by the segment's size class
  FreeBlocks unmapped_large_;
  int use_count_ = 0;
  int segments_ = 0;
  const std::shared_ptr<SegmentSource> source_;
};

// The largest free block in `pool`, 0 if none.
inline std::size_t largest_free_block(const Pool& pool) {
  std::size_t largest = 0;
  for (const FreeBlocks* set : {&pool.blocks_for(true), &pool.blocks_for(false)}) {
    set->for_each([&](const Block* b) { largest = std::max(largest, b->size); });
  }
  return largest;
}

}  // namespace gpumem
