// The free set: a pool's free blocks of one size class, binned by stream and size class, each
// class a red-black tree of the blocks themselves. Best fit, insert and erase are here; what a
// free block is and when it is in a set are block.h's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/block.h"
#include "core/free_tree.h"

namespace gpumem {

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
// A block in the set remembers its bins and class (Block::where), so erasing it looks nothing up.
//
// Invariants (check() asserts them): a block is in the tree of class_of(size) of its stream's bins,
// and its link names those bins and that class; each tree is a red-black tree in (size, address)
// order; a class's bit is set iff its tree is not empty, and a summary bit iff its word is not zero.
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

  // The same for a stream's bins already found (the cached path of a lane, core/lanes.h): these
  // neither look up nor remember a stream, so lanes of different streams may run them at once.
  static void insert_into(FreeBins& bins, Block* block);
  static Block* take_best_fit_in(FreeBins& bins, std::size_t size);
  // A stream's bins, if it has any; remembers nothing (no last-hit cache written).
  FreeBins* existing_bins(StreamId stream) const;

  bool contains(const Block* block) const;
  static bool contains_in(const FreeBins& bins, const Block* block);  // reads only those bins
  std::size_t size() const;  // counts the blocks: for the invariant checker
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
    if (size <= kSmallSize) return static_cast<unsigned>((size - 1) / kMinBlockSize);  // sizes are at least 1
    const unsigned log2 = 63 - static_cast<unsigned>(__builtin_clzll(size));  // 20 or more
    const auto sub = static_cast<unsigned>(size >> (log2 - 4)) & 15;           // the 4 bits below the top one
    return kExactClasses + (log2 - 20) * 16 + sub;
  }

 private:
  using StreamBins = FreeBins;
  static constexpr unsigned kWords = kClasses / 64;
  static constexpr unsigned kNone = kClasses;  // next_class: no non-empty class
  static_assert(kSmallSize == std::size_t{1} << 20, "class_of counts powers of two from 2^20");
  static_assert(kClasses % 64 == 0 && kWords < 64, "the bitmap is two levels of 64-bit words");

  StreamBins* find(StreamId stream) const;
  StreamBins* find_slow(StreamId stream) const;
  static bool stream_below(const std::unique_ptr<StreamBins>& bins, StreamId stream);
  StreamBins& find_or_add(StreamId stream);
  StreamBins& add(StreamId stream);  // out of line: a new stream is rare
  static unsigned next_class(const StreamBins& bins, unsigned from);  // first non-empty >= from, or kNone
  static void unlink(StreamBins& bins, unsigned cls, Block* block);
  static const Block* first(const StreamBins& bins);
  static const Block* next(const StreamBins& bins, const Block* block);

  std::vector<std::unique_ptr<StreamBins>> streams_;  // sorted by stream
  mutable StreamBins* last_ = nullptr;                // the last stream looked up
};

// The free blocks of one stream (FreeBlocks::StreamBins).
struct FreeBins {
  StreamId stream = 0;
  std::uint64_t summary = 0;                           // bit w: words[w] != 0
  std::uint64_t words[FreeBlocks::kClasses / 64] = {};  // bit c: roots[c] != nullptr
  Block* roots[FreeBlocks::kClasses] = {};              // the tree of each class
};


// ---- inline: the cached path ----

inline FreeBlocks::StreamBins* FreeBlocks::find(StreamId stream) const {
  if (last_ && last_->stream == stream) return last_;
  return find_slow(stream);
}

inline FreeBlocks::StreamBins& FreeBlocks::find_or_add(StreamId stream) {
  StreamBins* bins = find(stream);
  return bins ? *bins : add(stream);
}

inline unsigned FreeBlocks::next_class(const StreamBins& bins, unsigned from) {
  if (from >= kClasses) return kNone;
  unsigned w = from / 64;
  const std::uint64_t here = bins.words[w] & (~std::uint64_t{0} << (from % 64));
  if (here) return w * 64 + static_cast<unsigned>(__builtin_ctzll(here));
  const std::uint64_t later = bins.summary & (~std::uint64_t{0} << (w + 1));  // w + 1 <= kWords < 64
  if (!later) return kNone;
  w = static_cast<unsigned>(__builtin_ctzll(later));
  return w * 64 + static_cast<unsigned>(__builtin_ctzll(bins.words[w]));
}

inline void FreeBlocks::insert(Block* block) { insert_into(find_or_add(block->stream), block); }

inline void FreeBlocks::insert_into(FreeBins& bins, Block* block) {
  const unsigned cls = class_of(block->size);
  if (!bins.roots[cls]) {
    bins.words[cls / 64] |= std::uint64_t{1} << (cls % 64);
    bins.summary |= std::uint64_t{1} << (cls / 64);
  }
  free_tree::insert(bins.roots[cls], block);
  block->where.file(&bins, cls);
}

inline void FreeBlocks::unlink(StreamBins& bins, unsigned cls, Block* block) {
  free_tree::erase(bins.roots[cls], block);
  if (bins.roots[cls]) return;
  std::uint64_t& word = bins.words[cls / 64];
  word &= ~(std::uint64_t{1} << (cls % 64));
  if (!word) bins.summary &= ~(std::uint64_t{1} << (cls / 64));
}

inline void FreeBlocks::erase(Block* block) { unlink(*block->where.bins, block->where.cls, block); }

inline Block* FreeBlocks::take_best_fit(StreamId stream, std::size_t size) {
  StreamBins* bins = find(stream);
  return bins ? take_best_fit_in(*bins, size) : nullptr;
}

inline Block* FreeBlocks::take_best_fit_in(FreeBins& bins, std::size_t size) {
  unsigned cls = class_of(size);
  Block* block = free_tree::lower_bound(bins.roots[cls], size);
  if (!block) {
    cls = next_class(bins, cls + 1);
    if (cls == kNone) return nullptr;
    block = free_tree::extreme(bins.roots[cls], 0);
  }
  unlink(bins, cls, block);
  return block;
}

}  // namespace gpumem
