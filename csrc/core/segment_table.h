// The segments of one device by address: the one owner of every Segment, from the moment the
// memory is the allocator's until it goes back.
//
// Invariants: segments never overlap (a backend that hands out memory the table holds already is
// broken, and filing it would corrupt the table: overlaps() is asked first, and the request fails);
// a segment's head Block is made by, and goes back to, the arena of its stream (core/lanes.h);
// serials grow by one per segment filed, so snapshots order segments by age.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "core/block.h"
#include "core/block_arena.h"
#include "core/pool.h"
#include "core/segment_source.h"

namespace gpumem {

class DeviceAllocator;

class SegmentTable {
 public:
  using Map = std::map<std::uintptr_t, std::unique_ptr<Segment>>;

  SegmentTable(int device, DeviceAllocator* owner) : device_(device), owner_(owner) {}
  SegmentTable(const SegmentTable&) = delete;
  SegmentTable& operator=(const SegmentTable&) = delete;

  // Files [addr, addr + size) of `pool`'s memory from `source` as one segment of one block, its
  // head made by `arena`: mapped whole, or for a growable segment an address range with no page
  // mapped yet (GrowableSegments maps them). Statistics are the caller's.
  Segment* add(Pool& pool, SegmentSource& source, BlockArena& arena, bool small, StreamId stream, std::uintptr_t addr,
               std::size_t size, std::size_t chunk);
  // Forgets a segment whose memory went back; its head goes back to `arena`.
  void erase(Segment* segment, BlockArena& arena);
  bool overlaps(std::uintptr_t addr, std::size_t size) const;
  // A RuntimeError in Python: what `call` of the backend handed out overlaps the table.
  [[noreturn]] void throw_overlap(const char* call, std::uintptr_t addr, std::size_t size) const;
  // The segment holding `addr`, or nullptr.
  const Segment* containing(std::uintptr_t addr) const;

  // By address, oldest address first; each entry's Segment may be changed, not the table.
  Map::const_iterator begin() const { return segments_.begin(); }
  Map::const_iterator end() const { return segments_.end(); }
  std::size_t size() const { return segments_.size(); }

 private:
  const int device_;
  DeviceAllocator* const owner_;  // what Segment::owner names
  Map segments_;
  std::uint64_t next_serial_ = 0;
};

}  // namespace gpumem
