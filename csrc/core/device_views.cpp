// DeviceCore's calls for the facade (core/device_allocator.h): its settings, the views of its
// memory (snapshots, work counts) and the sharing's hooks; each runs under the whole device, which
// the facade holds, unless it says otherwise.
#include "core/device_core.h"

namespace gpumem {

DeviceSettings DeviceCore::settings() const {
  return {scope_.scope(), release_.threshold(), sources_.growable.in_effect(), sources_.growable.large_chunk()};
}

void DeviceCore::set_share(ShareHooks* share) {
  share_ = share;
  if (!share) d_.accounts.set_ceiling(SIZE_MAX);
}

std::optional<MemInfo> DeviceCore::mem_info_outside_capture() const {
  if (d_.capturing()) return std::nullopt;
  return d_.backend.mem_info(d_.device);
}

void DeviceCore::set_shared_ceiling(std::size_t bytes) {
  d_.accounts.set_ceiling(bytes);
  release_.over_limit();  // a neighbour's floor came back: cache first, as after a lowered limit
}

WorkCounts DeviceCore::work_counts() const {
  WorkCounts counts;
  counts.on_device = on_device_;
  d_.lanes.for_each_arena([&](const BlockArena& arena, int) { counts.blocks_made += arena.made(); });
  counts.growable_blocks_visited = sources_.growable.blocks_visited();
  counts.growable_moved = sources_.growable.moved();
  counts.growable_allowance = sources_.growable.allowance();
  return counts;
}

namespace {

BlockInfo info_of(const Block& b) {
  const auto state = b.allocated ? BlockInfo::kAllocated : (b.pending_events > 0 ? BlockInfo::kPendingFree : BlockInfo::kFree);
  return {b.addr, b.size, b.requested, state};
}

}  // namespace

// A plain segment is one SegmentInfo; a growable one, one per mapped stretch, so the segments of a
// snapshot add up to the reserved bytes.
std::vector<SegmentInfo> DeviceCore::snapshot() const {
  std::vector<SegmentInfo> out;
  out.reserve(d_.segments.size());
  for (const auto& [addr, segment] : d_.segments) {
    const Segment& s = *segment;
    for_each_stretch(s, [&](const Block* first, const Block* end, std::uintptr_t stop) {
      SegmentInfo info{first->addr, stop - first->addr, s.stream, s.pool->id(), s.small, s.growable, {}, !s.paused.empty()};
      for (const Block* b = first; b != end; b = b->next) info.blocks.push_back(info_of(*b));
      out.push_back(std::move(info));
    });
  }
  return out;
}

std::optional<std::pair<std::uintptr_t, std::size_t>> DeviceCore::segment_of(std::uintptr_t addr) const {
  const Segment* holding = d_.segments.containing(addr);
  if (!holding) return std::nullopt;
  const Segment& s = *holding;
  if (!s.growable) return std::make_pair(s.addr, s.size);
  std::optional<std::pair<std::uintptr_t, std::size_t>> stretch;  // the mapped stretch holding `addr`
  for_each_stretch(s, [&](const Block* first, const Block*, std::uintptr_t stop) {
    if (addr >= first->addr && addr < stop) stretch = std::make_pair(first->addr, stop - first->addr);
  });
  return stretch;
}

// The allocated block holding `addr` and the memory behind it; nullopt where no allocated block
// holds it (not gpumem's, or free).
std::optional<ShareRange> DeviceCore::share_range(std::uintptr_t addr) const {
  const Segment* holding = d_.segments.containing(addr);
  if (!holding) return std::nullopt;
  const Segment& s = *holding;
  const Block* block = s.head;
  while (block && !(addr >= block->addr && addr < block->addr + block->size)) block = block->next;
  if (!block || !block->allocated) return std::nullopt;
  ShareRange range{block->addr, block->size, s.growable, {}};
  if (!s.growable) {
    range.memory.emplace_back(s.addr, s.size);
    return range;
  }
  // The chunks [block->addr, end) lies on: the last starting at or before its start, up to the
  // last starting before its end (chunks tile the mapped stretches, and an allocated block is mapped).
  const std::uintptr_t end = block->addr + block->size;
  auto chunk = s.chunks.upper_bound(block->addr);
  if (chunk == s.chunks.begin()) throw std::logic_error("gpumem: an allocated block of a growable segment lies on no chunk");
  for (--chunk; chunk != s.chunks.end() && *chunk < end; ++chunk) range.memory.emplace_back(*chunk, s.chunk);
  return range;
}

// Reads only the blocks of the block's stream, so its lane is enough where it has one: what else
// changes them (the whole device) holds every lane. A recorded malloc asks this after each call,
// and threads on other streams go on meanwhile.
bool DeviceCore::heads_a_split(const Block* block) const {
  const auto read = [block] {
    const bool starts = block->prev == nullptr || !block->prev->mapped;
    // Free mapped neighbours always merge, so a cached block right behind is the rest of a split.
    return starts && block->next != nullptr && block->next->is_cached();
  };
  if (LaneSlot* slot = d_.lanes.slot_of(block->stream)) {
    const LaneGuard lane(*slot->lane);
    return read();
  }
  const WholeDevice whole(*this);
  return read();
}

void DeviceCore::set_pool_option(PoolId id, PoolOption option, bool on) {
  d_.pools.existing(id).set_option(option, on);
}

}  // namespace gpumem
