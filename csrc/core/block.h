// Blocks and segments (pools are core/pool.h, the free set core/free_set.h).
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
#include <set>
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
struct FreeBins;

// A free block's place in the free set (see FreeBlocks), valid while it is in one: the bins and
// size class it is filed under, and its links in that class's tree.
struct FreeLink {
  Block* parent = nullptr;
  Block* child[2] = {nullptr, nullptr};  // lower, higher (size, address)
  FreeBins* bins = nullptr;
  unsigned cls = 0;
  bool red = false;
};

// Aligned to a cache line (two lines each): blocks of different streams are worked on by different
// threads at once (core/lanes.h), and must not share a line.
struct alignas(64) Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;       // bytes the caller asked for; 0 while free (kept while pending)
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

struct Segment {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  StreamId stream = 0;
  Pool* pool = nullptr;
  bool small = false;            // small-pool segment
  bool growable = false;         // an address range mapped page by page (see core/growable_segments.cpp)
  std::size_t mapped = 0;        // bytes backed by memory: `size` for a plain segment
  // The starts of a growable segment's physical allocations (chunks), each `chunk` bytes: each was
  // mapped by one Backend::map call and goes back whole (Note [physical chunks],
  // core/growable_segments.cpp). `size` is whole chunks.
  std::set<std::uintptr_t> chunks;
  std::size_t chunk = 0;         // a growable segment's chunk size; 0 for a plain segment
  std::uint64_t serial = 0;      // creation order: lower is older
  SegmentSource* source = nullptr;  // where it goes back: its pool's source
  Block* head = nullptr;
  DeviceAllocator* owner = nullptr;

  // A plain segment that is one free block: it can go back to the device whole.
  bool is_unused() const { return !growable && head->is_free() && head->size == size; }
};

// Calls f(first, end, stop) for each mapped stretch of `segment`: its first block, the block after
// it (nullptr at the segment's end) and the address it stops at. A plain segment is one stretch.
// Unmapped blocks are whole chunks, so in a growable segment a stretch is whole chunks too.
template <typename F>
void for_each_stretch(const Segment& segment, F f) {
  for (const Block* b = segment.head; b;) {
    if (!b->mapped) {
      b = b->next;
      continue;
    }
    const Block* end = b;
    while (end && end->mapped) end = end->next;
    f(b, end, end ? end->addr : segment.addr + segment.size);
    b = end;
  }
}

}  // namespace gpumem
