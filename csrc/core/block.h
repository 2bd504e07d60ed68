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

#include <algorithm>
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
// Changed only by the free set (core/free_set.h, core/free_tree.{h,cpp}), through these methods.
struct FreeLink {
  Block* parent = nullptr;
  Block* child[2] = {nullptr, nullptr};  // lower, higher (size, address)
  FreeBins* bins = nullptr;
  unsigned cls = 0;
  bool red = false;

  void set_parent(Block* p) { parent = p; }
  void set_child(int side, Block* c) { child[side] = c; }
  void set_red(bool r) { red = r; }
  void file(FreeBins* in, unsigned size_class) {  // filed under `in`'s class `size_class`
    bins = in;
    cls = size_class;
  }
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

  // State changes, the only writes to these fields outside this header (all inline: the hot path
  // compiles to the same stores).
  // A fresh block of `seg`: [at, at + bytes) of stream `on`, linked to nothing.
  void place(Segment* seg, std::uintptr_t at, std::size_t bytes, StreamId on, bool is_mapped) {
    addr = at;
    size = bytes;
    stream = on;
    segment = seg;
    mapped = is_mapped;
    prev = next = nullptr;
  }
  // Linked in right after `before`, in address order.
  void link_after(Block* before) {
    prev = before;
    next = before->next;
    if (next) next->prev = this;
    before->next = this;
  }
  // Folds the block after it into it; returns that block, linked to nothing of the segment's now.
  Block* absorb_next() {
    Block* later = next;
    size += later->size;
    next = later->next;
    if (next) next->prev = this;
    return later;
  }
  void resize(std::size_t bytes) { size = bytes; }
  void set_mapped(bool is_mapped) { mapped = is_mapped; }
  void chain_spare(Block* spare) { next = spare; }  // BlockArena's list of spare blocks
  void mark_allocated(std::size_t requested_bytes) {
    allocated = true;
    requested = requested_bytes;
  }
  void mark_freed() { allocated = false; }
  void clear_requested() { requested = 0; }
  void pend(int events) { pending_events = events; }  // in use on `events` more streams (0: none)
  void event_done() { --pending_events; }
  void use_on(StreamId other) {  // used on `other` too (record_stream), each stream once
    if (other != stream && std::find(stream_uses.begin(), stream_uses.end(), other) == stream_uses.end()) {
      stream_uses.push_back(other);
    }
  }
  void forget_stream_uses() { stream_uses.clear(); }

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
  // The starts of a growable segment's physical allocations (chunks), each `chunk` bytes: each was
  // mapped by one Backend::map call and goes back whole (Note [physical chunks],
  // core/growable_segments.cpp). `size` is whole chunks.
  std::set<std::uintptr_t> chunks;
  // A paused region's chunks (core/pause.cpp): unmapped, to be mapped again at the same addresses.
  // Its mapped blocks lie on them meanwhile; `chunks` is empty then.
  std::set<std::uintptr_t> paused;
  std::size_t chunk = 0;         // a growable segment's chunk size; 0 for a plain segment
  std::uint64_t serial = 0;      // creation order: lower is older
  SegmentSource* source = nullptr;  // where it goes back: its pool's source
  Block* head = nullptr;
  DeviceAllocator* owner = nullptr;

  // A segment of [at, at + bytes): growable, with chunks of `chunk_bytes`, where that is not 0 (and
  // then nothing mapped yet), else plain (all of it mapped). SegmentTable::add makes each.
  Segment(std::uintptr_t at, std::size_t bytes, StreamId on, Pool* of, bool is_small, std::size_t chunk_bytes,
          std::uint64_t made, SegmentSource* goes_to, DeviceAllocator* owned_by)
      : addr(at), size(bytes), stream(on), pool(of), small(is_small), growable(chunk_bytes > 0), chunk(chunk_bytes),
        serial(made), source(goes_to), owner(owned_by) {}

  void set_head(Block* first) { head = first; }
  // [at, at + bytes), whole chunks, mapped now / unmapped now (a growable segment's).
  void add_chunks(std::uintptr_t at, std::size_t bytes) {
    for (std::size_t done = 0; done < bytes; done += chunk) chunks.insert(at + done);
  }
  void remove_chunks(std::uintptr_t lo, std::uintptr_t hi) { chunks.erase(chunks.lower_bound(lo), chunks.lower_bound(hi)); }
  // Bytes backed by memory: all of a plain segment, a growable one's chunks.
  std::size_t mapped() const { return growable ? chunks.size() * chunk : size; }
  // Bytes its mapped blocks lie on: mapped() and, while paused, its paused chunks.
  std::size_t laid() const { return mapped() + paused.size() * chunk; }

  // A plain segment that is one free block: it can go back to the device whole.
  bool is_unused() const { return !growable && head->is_free() && head->size == size; }
};

// Calls f(lo, hi) for each run of adjacent chunks of `chunk` bytes in `chunks` (a segment's chunks
// or its paused ones), in address order.
template <typename F>
void for_each_run(const std::set<std::uintptr_t>& chunks, std::size_t chunk, F f) {
  for (auto it = chunks.begin(); it != chunks.end();) {
    const std::uintptr_t lo = *it;
    std::uintptr_t hi = lo + chunk;
    for (++it; it != chunks.end() && *it == hi; ++it) hi += chunk;
    f(lo, hi);
  }
}

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
