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
//   - a segment's source is its pool's (the backend's for growable segments); a pool with a
//     source of its own has only plain segments
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "core/sizing.h"

namespace gpumem {

class DeviceAllocator;
class SegmentSource;
struct Segment;
struct Pool;

struct Block;

// A free block's links in the tree of its size class (see FreeBlocks), valid while it is free.
struct FreeLink {
  Block* parent = nullptr;
  Block* child[2] = {nullptr, nullptr};  // lower, higher (size, address)
  bool red = false;
};

struct Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;       // bytes the caller asked for; 0 while free
  StreamId stream = 0;             // the segment's stream, copied here for the free-set order
  Segment* segment = nullptr;
  Block* prev = nullptr;           // neighbours in address order within the segment
  Block* next = nullptr;
  bool allocated = false;
  bool mapped = true;              // false: an unmapped stretch of a growable segment (free, no memory)
  int pending_events = 0;          // freed by the caller, still in use on other streams
  FreeLink where;                  // its place in the free set, valid while it is free
  std::vector<StreamId> stream_uses;  // streams other than `stream` that used the block

  void* ptr() const { return reinterpret_cast<void*>(addr); }
  bool is_free() const { return !allocated && pending_events == 0; }
  bool is_cached() const { return is_free() && mapped; }  // free memory that is reserved
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

// One size class (small or large) of a pool's free blocks.
//
// Design note. Best fit runs on every cached allocation, and a split or merge adds up to three
// inserts and erases around it, so these must cost a few dozen instructions, not a tree walk over
// every free block of the pool with a node handle moved in and out (what std::set cost: about 45%
// of a malloc+free pair). The blocks are therefore binned twice before anything is ordered:
//   - by stream: one StreamBins per stream, found through a last-hit cache (most programs use one
//     to three streams) and else a binary search; a request never sees another stream's blocks.
//   - by size class: sizes up to 1 MiB (the small pool; multiples of 512) have one exact class per
//     512 bytes, 2048 in all; larger sizes have 16 log-linear classes per power of two. Classes
//     are monotone in size, so every block of a higher class is at least as large as any request
//     of a lower one, and a bitmap of non-empty classes (two levels of 64-bit words) finds the next
//     non-empty class with two ctz.
// Each class is a red-black tree ordered by (size, address) whose nodes are the blocks themselves
// (Block::where): no allocation per operation, erase from the block's own position. Best fit is a
// lower_bound in the request's class, else the lowest (size, address) of the next non-empty class:
// exactly the smallest block of at least the size, the lowest address among equals, and O(log n)
// at worst (a class holds at most n blocks; the bitmap scan is constant). Classes typically hold
// zero to two blocks, so most operations are a root assignment and a bit flip. The price is memory:
// a stream's bins hold a root per class, about 22 KB, for each pool and size class it is used in.
//
// Invariants (check() asserts them): a block is in the tree of class_of(size) of its stream's bins;
// each tree is a red-black tree in (size, address) order; a class's bit is set iff its tree is not
// empty, and a summary bit iff its word is not zero; size() counts the blocks in all trees.
class FreeBlocks {
 public:
  FreeBlocks() = default;
  FreeBlocks(const FreeBlocks&) = delete;
  FreeBlocks& operator=(const FreeBlocks&) = delete;

  void insert(Block* block);
  void erase(Block* block);
  // The smallest free block on `stream` of at least `size` bytes (the lowest address among equal
  // sizes), removed; nullptr if none.
  Block* take_best_fit(StreamId stream, std::size_t size);

  bool contains(const Block* block) const;
  std::size_t size() const { return count_; }
  // Throws std::logic_error unless the invariants below hold: for tests and the invariant checker.
  void check() const;
  template <typename F>
  void for_each(F f) const {
    for (const auto& bins : streams_) {
      for (const Block* b = first(*bins); b; b = next(*bins, b)) f(b);
    }
  }
  // The blocks of one stream, smallest first.
  template <typename F>
  void for_each_on(StreamId stream, F f) const {
    if (const StreamBins* bins = find_slow(stream)) {
      for (const Block* b = first(*bins); b; b = next(*bins, b)) f(b);
    }
  }

  // Size classes: one per 512 bytes up to 1 MiB, then 16 per power of two up to 2^64.
  static constexpr unsigned kExactClasses = kSmallSize / kMinBlockSize;
  static constexpr unsigned kClasses = kExactClasses + (64 - 20) * 16;
  static unsigned class_of(std::size_t size) {
    if (size <= kSmallSize) return size <= kMinBlockSize ? 0 : static_cast<unsigned>((size - 1) / kMinBlockSize);
    const unsigned log2 = 63 - static_cast<unsigned>(__builtin_clzll(size));  // 20 or more
    const auto sub = static_cast<unsigned>(size >> (log2 - 4)) & 15;           // the 4 bits below the top one
    return kExactClasses + (log2 - 20) * 16 + sub;
  }

 private:
  struct StreamBins;
  static constexpr unsigned kWords = kClasses / 64;
  static constexpr unsigned kNone = kClasses;  // next_class: no non-empty class
  static_assert(kSmallSize == std::size_t{1} << 20, "class_of counts powers of two from 2^20");
  static_assert(kClasses % 64 == 0 && kWords < 64, "the bitmap is two levels of 64-bit words");

  StreamBins* find(StreamId stream) const;
  StreamBins* find_slow(StreamId stream) const;
  static bool stream_below(const std::unique_ptr<StreamBins>& bins, StreamId stream);
  StreamBins& find_or_add(StreamId stream);
  StreamBins& add(StreamId stream);
  static unsigned next_class(const StreamBins& bins, unsigned from);  // first non-empty >= from, or kNone
  void unlink(StreamBins& bins, unsigned cls, Block* block);
  static const Block* first(const StreamBins& bins);
  static const Block* next(const StreamBins& bins, const Block* block);

  std::vector<std::unique_ptr<StreamBins>> streams_;  // sorted by stream
  mutable StreamBins* last_ = nullptr;                // the last stream looked up
  std::size_t count_ = 0;
};

// The free blocks of one stream.
struct FreeBlocks::StreamBins {
  StreamId stream = 0;
  std::uint64_t summary = 0;         // bit w: words[w] != 0
  std::uint64_t words[kWords] = {};  // bit c: roots[c] != nullptr
  Block* roots[kClasses] = {};       // the tree of each class
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

struct Segment {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  StreamId stream = 0;
  Pool* pool = nullptr;
  bool small = false;            // small-pool segment
  bool growable = false;         // an address range mapped page by page (see core/growable.cpp)
  std::size_t mapped = 0;        // bytes backed by memory: `size` for a plain segment
  std::uint64_t serial = 0;      // creation order: lower is older
  SegmentSource* source = nullptr;  // where it goes back: its pool's source
  Block* head = nullptr;
  DeviceAllocator* owner = nullptr;

  // A plain segment that is one free block: it can go back to the device whole.
  bool is_unused() const { return !growable && head->is_free() && head->size == size; }
};

}  // namespace gpumem
