// A free set's blocks of one stream read from the largest down: the order in which growable
// segments unmap free pages for a request (core/growable_segments.cpp).
//
// The order is (size descending, address ascending). A walk is a sequence of queries, each on the
// set as it is at that moment and O(log n) in its blocks: `after` finds the block that follows a
// position (the size and address of the block given last), so between steps the caller may take
// blocks out of the set and put in blocks smaller than the position.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/free_set.h"
#include "core/free_tree.h"

namespace gpumem::largest_first {

// Where a walk stands: the size and address of the block it gave last.
struct Position {
  std::size_t size;
  std::uintptr_t addr;
};
// Before the first block: no block is this large.
inline constexpr Position kStart{SIZE_MAX, UINTPTR_MAX};

namespace detail {

constexpr unsigned kNone = FreeBlocks::kClasses;

// The highest non-empty class below `cls`, or kNone (the bitmaps of FreeBins, read downwards).
inline unsigned class_below(const FreeBins& bins, unsigned cls) {
  unsigned w = cls / 64;
  const std::uint64_t here = bins.words[w] & ((std::uint64_t{1} << (cls % 64)) - 1);
  if (here) return w * 64 + 63 - static_cast<unsigned>(__builtin_clzll(here));
  const std::uint64_t earlier = bins.summary & ((std::uint64_t{1} << w) - 1);  // w < 64
  if (!earlier) return kNone;
  w = 63 - static_cast<unsigned>(__builtin_clzll(earlier));
  return w * 64 + 63 - static_cast<unsigned>(__builtin_clzll(bins.words[w]));
}

// In one class's tree: the lowest block of `size` bytes above `addr`, or nullptr.
inline Block* next_of_size(Block* root, std::size_t size, std::uintptr_t addr) {
  Block* found = nullptr;
  for (Block* cur = root; cur;) {
    const bool above = cur->size > size || (cur->size == size && cur->addr > addr);
    if (above) found = cur;
    cur = cur->where.child[above ? 0 : 1];
  }
  return found && found->size == size ? found : nullptr;
}

// In one class's tree: the highest block (in (size, address) order) of fewer than `size` bytes.
inline Block* highest_below(Block* root, std::size_t size) {
  Block* found = nullptr;
  for (Block* cur = root; cur;) {
    const bool below = cur->size < size;
    if (below) found = cur;
    cur = cur->where.child[below ? 1 : 0];
  }
  return found;
}

}  // namespace detail

// The block after `at` in (size descending, address ascending) order: the next address of the
// same size, else the lowest address of the largest smaller size; nullptr if none.
inline Block* after(const FreeBins& bins, Position at) {
  const unsigned cls = FreeBlocks::class_of(at.size);  // every block of at.size, and the smaller ones above
  if (Block* same = detail::next_of_size(bins.roots[cls], at.size, at.addr)) return same;
  Block* below = detail::highest_below(bins.roots[cls], at.size);
  if (!below) {
    const unsigned lower = detail::class_below(bins, cls);
    if (lower == detail::kNone) return nullptr;
    below = free_tree::extreme(bins.roots[lower], 1);
  }
  return free_tree::lower_bound(bins.roots[below->where.cls], below->size);  // the lowest address of its size
}

// Whether `a` comes before `b` in that order.
inline bool before(const Block* a, const Block* b) {
  return a->size != b->size ? a->size > b->size : a->addr < b->addr;
}

}  // namespace gpumem::largest_first
