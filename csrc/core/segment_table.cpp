// The segments of one device by address (core/segment_table.h): filing, forgetting, finding.
#include "core/segment_table.h"

#include <stdexcept>
#include <string>

namespace gpumem {

Segment* SegmentTable::add(Pool& pool, SegmentSource& source, BlockArena& arena, bool small, StreamId stream,
                           std::uintptr_t addr, std::size_t size, std::size_t chunk) {
  auto segment = std::make_unique<Segment>(addr, size, stream, &pool, small, chunk, next_serial_++, &source, owner_);
  Block* head = arena.make();
  head->place(segment.get(), addr, size, stream, !segment->growable);
  segment->set_head(head);
  pool.segment_filed();
  return segments_.emplace(addr, std::move(segment)).first->second.get();
}

void SegmentTable::erase(Segment* segment, BlockArena& arena) {
  segment->pool->segment_erased();
  arena.recycle(segment->head);
  segments_.erase(segment->addr);
}

bool SegmentTable::overlaps(std::uintptr_t addr, std::size_t size) const {
  auto after = segments_.lower_bound(addr);
  if (after != segments_.end() && after->first - addr < size) return true;
  if (after == segments_.begin()) return false;
  const Segment& before = *std::prev(after)->second;
  return addr - before.addr < before.size;
}

void SegmentTable::throw_overlap(const char* call, std::uintptr_t addr, std::size_t size) const {
  throw std::logic_error("gpumem: device " + std::to_string(device_) + "'s " + call + " handed out " +
                         std::to_string(size) + " bytes at " + std::to_string(addr) +
                         ", which overlap memory the allocator already holds; the backend is broken");
}

const Segment* SegmentTable::containing(std::uintptr_t addr) const {
  auto it = segments_.upper_bound(addr);
  if (it == segments_.begin()) return nullptr;
  const Segment* s = std::prev(it)->second.get();
  return addr < s->addr + s->size ? s : nullptr;
}

}  // namespace gpumem
