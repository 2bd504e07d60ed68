// What the parts of one device share (core/device_state.h): filing and forgetting segments in the segment table.
#include "core/device_state.h"

#include <stdexcept>
#include <string>

namespace gpumem {

DeviceState::DeviceState(Backend& backend, int device, DeviceAllocator* owner)
    : backend(backend), device(device), owner(owner), backend_source(backend, device), cap(0), pools(device) {}

Segment* DeviceState::add_segment(Pool& pool, bool small, StreamId stream, std::uintptr_t addr, std::size_t size) {
  auto segment = std::make_unique<Segment>();
  segment->addr = addr;
  segment->size = size;
  segment->stream = stream;
  segment->pool = &pool;
  segment->small = small;
  segment->serial = next_serial++;
  segment->source = &source_of(pool);
  segment->owner = owner;
  Block* head = arena_for(stream).make();
  head->addr = addr;
  head->size = size;
  head->stream = stream;
  head->segment = segment.get();
  head->prev = head->next = nullptr;
  head->mapped = true;
  segment->head = head;
  ++pool.segments;
  return segments.emplace(addr, std::move(segment)).first->second.get();
}

void DeviceState::erase_segment(Segment* segment) {
  --segment->pool->segments;
  arena_for(segment->stream).recycle(segment->head);
  segments.erase(segment->addr);
}

bool DeviceState::overlaps_segment(std::uintptr_t addr, std::size_t size) const {
  auto after = segments.lower_bound(addr);
  if (after != segments.end() && after->first - addr < size) return true;
  if (after == segments.begin()) return false;
  const Segment& before = *std::prev(after)->second;
  return addr - before.addr < before.size;
}

void DeviceState::throw_overlap(const char* call, std::uintptr_t addr, std::size_t size) const {
  throw std::logic_error("gpumem: device " + std::to_string(device) + "'s " + call + " handed out " +
                         std::to_string(size) + " bytes at " + std::to_string(addr) +
                         ", which overlap memory the allocator already holds; the backend is broken");
}

}  // namespace gpumem
