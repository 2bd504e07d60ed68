// The facade's calls: each takes the whole device and hands the work to the part that owns it
// (core/device_allocator.h).
#include "core/device_allocator.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/limit_spec.h"

namespace gpumem {

void DeviceAllocator::record_stream(Block* block, StreamId stream) {
  const WholeDevice whole(core_);
  if (stream == block->stream) return;
  auto& uses = block->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

void* DeviceAllocator::malloc_uncached(std::size_t size) {
  DeviceCore::Asking asking;
  for (;;) {
    {
      const WholeDevice whole(core_);
      if (void* ptr = core_.malloc_uncached(size, asking)) return ptr;
    }
    // Memory on its way back may make room (core/departures.h), or the others sharing the GPU.
    if (!core_.ask_neighbours(asking)) core_.d_.departing.wait();
  }
}

bool DeviceAllocator::free_uncached(void* ptr) {
  const WholeDevice whole(core_);
  return core_.free_uncached(ptr);
}

// Plain segments go back to the backend after the whole device is let go of (core/departures.h):
// a long cudaFree stalls no other thread's allocation.
void DeviceAllocator::empty_cache(PoolId pool) {
  std::vector<Departure> departing;
  std::exception_ptr error;
  {
    const WholeDevice whole(core_);
    try {
      core_.empty_cache(pool, &departing);
    } catch (...) {
      error = std::current_exception();  // what was taken out of the tables still goes back
    }
  }
  if (!departing.empty()) core_.give_back(departing);
  if (error) std::rethrow_exception(error);
}

// ---- the limit ----

void DeviceAllocator::set_limit(std::optional<std::size_t> limit) {
  check_limit_fits(limit, device(), device_total());
  const WholeDevice whole(core_);
  core_.set_limit(limit.value_or(device_total()));
}

void DeviceAllocator::set_limit(std::string_view spec) {
  const std::optional<std::size_t> limit = parse_limit(spec, device_total());
  const WholeDevice whole(core_);
  core_.set_limit(limit.value_or(device_total()));
}

void DeviceAllocator::set_scope(LimitScope scope) {
  const WholeDevice whole(core_);
  core_.set_scope(scope);
}

DeviceSettings DeviceAllocator::settings() const {
  const WholeDevice whole(core_);
  return {core_.scope_.scope(), core_.release_.threshold(), core_.sources_.growable.in_effect()};
}

void DeviceAllocator::set_share(ShareHooks* share) {
  {
    const WholeDevice whole(core_);
    core_.d_.share = share;
    if (!share) core_.d_.accounts.set_ceiling(SIZE_MAX);
  }
  // Asks already handed the old hooks run with no lock held: the hooks may go once they ended
  // (each is bounded by the sharing's own wait).
  for (;;) {
    {
      const WholeDevice whole(core_);
      if (!core_.asks_in_flight()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::optional<MemInfo> DeviceAllocator::mem_info_outside_capture() {
  const WholeDevice whole(core_);
  if (core_.d_.capturing()) return std::nullopt;
  return core_.d_.backend.mem_info(core_.d_.device);
}

void DeviceAllocator::set_shared_ceiling(std::size_t bytes) {
  const WholeDevice whole(core_);
  core_.d_.accounts.set_ceiling(bytes);
  core_.release_.over_limit();  // a neighbour's floor came back: cache first, as after a lowered limit
}

void DeviceAllocator::watch_pressure(int slot, double share) {
  const WholeDevice whole(core_);
  core_.d_.accounts.watch_pressure(slot, share);
}

void DeviceAllocator::set_release_threshold(double share) {
  const WholeDevice whole(core_);  // CacheRelease::set_threshold checks the share before it changes anything
  core_.release_.set_threshold(share);
}

// ---- how memory is made ----

void DeviceAllocator::set_growable(bool on) {
  const WholeDevice whole(core_);
  core_.sources_.growable.set_on(on);
}

void DeviceAllocator::set_capture_reuse(bool on) {
  const WholeDevice whole(core_);
  core_.events_.set_capture_reuse(on);
}

// ---- statistics and views ----

DeviceStats DeviceAllocator::stats() const {
  const WholeDevice whole(core_);
  return core_.d_.accounts.ledger().snapshot();
}

void DeviceAllocator::reset_peak_stats() {
  const WholeDevice whole(core_);
  core_.d_.accounts.reset_peaks();
}

void DeviceAllocator::reset_accumulated_stats() {
  const WholeDevice whole(core_);
  core_.d_.accounts.ledger().reset_accumulated();
}

WorkCounts DeviceAllocator::work_counts() const {
  const WholeDevice whole(core_);
  WorkCounts counts;
  counts.on_device = core_.on_device_;
  core_.d_.lanes.for_each_arena([&](const BlockArena& arena, int) { counts.blocks_made += arena.made(); });
  counts.growable_blocks_visited = core_.sources_.growable.blocks_visited();
  counts.growable_moved = core_.sources_.growable.moved();
  counts.growable_allowance = core_.sources_.growable.allowance();
  return counts;
}

std::size_t DeviceAllocator::largest_free_block() const {
  const WholeDevice whole(core_);
  return core_.largest_free_block();
}

namespace {

BlockInfo info_of(const Block& b) {
  const auto state = b.allocated ? BlockInfo::kAllocated : (b.pending_events > 0 ? BlockInfo::kPendingFree : BlockInfo::kFree);
  return {b.addr, b.size, b.requested, state};
}

}  // namespace

// A plain segment is one SegmentInfo; a growable one, one per mapped stretch, so the segments of a
// snapshot add up to the reserved bytes.
std::vector<SegmentInfo> DeviceAllocator::snapshot() const {
  const WholeDevice whole(core_);
  std::vector<SegmentInfo> out;
  out.reserve(core_.d_.segments.size());
  for (const auto& [addr, segment] : core_.d_.segments) {
    const Segment& s = *segment;
    for_each_stretch(s, [&](const Block* first, const Block* end, std::uintptr_t stop) {
      SegmentInfo info{first->addr, stop - first->addr, s.stream, s.pool->id, s.small, s.growable, {}};
      for (const Block* b = first; b != end; b = b->next) info.blocks.push_back(info_of(*b));
      out.push_back(std::move(info));
    });
  }
  return out;
}

std::optional<std::pair<std::uintptr_t, std::size_t>> DeviceAllocator::segment_of(const void* ptr) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  const WholeDevice whole(core_);
  const Segment* holding = core_.d_.segments.containing(addr);
  if (!holding) return std::nullopt;
  const Segment& s = *holding;
  if (!s.growable) return std::make_pair(s.addr, s.size);
  std::optional<std::pair<std::uintptr_t, std::size_t>> stretch;  // the mapped stretch holding `addr`
  for_each_stretch(s, [&](const Block* first, const Block*, std::uintptr_t stop) {
    if (addr >= first->addr && addr < stop) stretch = std::make_pair(first->addr, stop - first->addr);
  });
  return stretch;
}

// Reads only the blocks of the block's stream, so its lane is enough where it has one: what else
// changes them (the whole device) holds every lane. A recorded malloc asks this after each call,
// and threads on other streams go on meanwhile.
bool DeviceAllocator::heads_a_split(const Block* block) const {
  const auto read = [block] {
    const bool starts = block->prev == nullptr || !block->prev->mapped;
    // Free mapped neighbours always merge, so a cached block right behind is the rest of a split.
    return starts && block->next != nullptr && block->next->is_cached();
  };
  if (LaneSlot* slot = core_.d_.lanes.slot_of(block->stream)) {
    const LaneGuard lane(*slot->lane);
    return read();
  }
  const WholeDevice whole(core_);
  return read();
}

// ---- private pools ----

void DeviceAllocator::create_pool(PoolId id, std::shared_ptr<SegmentSource> source) {
  const WholeDevice whole(core_);
  core_.d_.pools.create(id, std::move(source));
}

void DeviceAllocator::begin_allocate_to_pool(PoolId id, StreamFilter filter) {
  const WholeDevice whole(core_);
  core_.d_.pools.begin_target(id, std::move(filter));
}

void DeviceAllocator::end_allocate_to_pool(PoolId id) {
  const WholeDevice whole(core_);
  core_.end_target(id);
}

void DeviceAllocator::release_pool(PoolId id) {
  const WholeDevice whole(core_);
  core_.release_pool(id);
}

int DeviceAllocator::pool_use_count(PoolId id) const {
  const WholeDevice whole(core_);
  return core_.d_.pools.use_count(id);
}

void DeviceAllocator::set_pool_option(PoolId id, PoolOption option, bool on) {
  const WholeDevice whole(core_);
  Pool& pool = core_.d_.pools.existing(id);
  if (option == PoolOption::kUseOnOom) {
    pool.use_on_oom = on;
  } else if (on) {
    pool.no_split = true;
  } else {
    throw std::invalid_argument("gpumem: a pool's no_split can only be turned on (its blocks may be split already)");
  }
}

void DeviceAllocator::check_invariants() const {
  const WholeDevice whole(core_);
  check_device(core_);
}

}  // namespace gpumem
