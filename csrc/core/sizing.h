// How requests become block and segment sizes. The numbers follow PyTorch's native allocator, so
// a job's memory profile looks the same under gpumem.
#pragma once

#include <cstddef>

namespace gpumem {

constexpr std::size_t kMinBlockSize = 512;             // every block is a multiple of this
constexpr std::size_t kSmallSize = 1 << 20;            // requests up to this use the small pool
constexpr std::size_t kSmallSegment = 2 << 20;         // small-pool segments
constexpr std::size_t kMidSegment = 20 << 20;          // segments for requests of 1 to 10 MiB
constexpr std::size_t kMinLargeAlloc = 10 << 20;       // from here a request gets its own segment
constexpr std::size_t kLargeRounding = 2 << 20;        // large segments are multiples of this

constexpr std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// Block size for a request: at least 512 bytes, a multiple of 512.
constexpr std::size_t round_size(std::size_t requested) {
  return requested < kMinBlockSize ? kMinBlockSize : round_up(requested, kMinBlockSize);
}

// The smallest of `divisions` equal steps between the powers of two around `size` that holds it:
// PyTorch's roundup_power2_divisions, which trades a little memory per block for block sizes that
// repeat. A power of two stays as it is.
constexpr std::size_t round_to_division(std::size_t size, std::size_t divisions) {
  if (size == 0 || divisions == 0 || (size & (size - 1)) == 0) return size;
  const std::size_t floor = std::size_t{1} << (63 - __builtin_clzll(size));
  const std::size_t step = floor >> (63 - __builtin_clzll(divisions));
  if (step == 0) return floor << 1;
  const std::size_t down = size & ~(step - 1);
  return down == size ? size : down + step;
}

constexpr bool is_small(std::size_t block_size) { return block_size <= kSmallSize; }

// The segment the pool would normally reserve for a block of `size`.
constexpr std::size_t segment_size(std::size_t size) {
  if (is_small(size)) return kSmallSegment;
  if (size < kMinLargeAlloc) return kMidSegment;
  return round_up(size, kLargeRounding);
}

// The smallest segment that can hold a block of `size`: what is tried when the normal segment
// would pass the limit but this one would not.
constexpr std::size_t tight_segment_size(std::size_t size) {
  return is_small(size) ? kSmallSegment : round_up(size, kLargeRounding);
}

// A free block of `block_size` serving `size` is split when the remainder is worth keeping:
// any 512-byte remainder in the small pool; more than 1 MiB in the large pool (smaller large-pool
// remainders would only fragment it).
constexpr bool should_split(std::size_t block_size, std::size_t size) {
  const std::size_t remaining = block_size - size;
  return is_small(size) ? remaining >= kMinBlockSize : remaining > kSmallSize;
}

}  // namespace gpumem
