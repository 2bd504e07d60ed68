#include "core/device_allocator.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/limit_spec.h"
#include "core/sizing.h"

namespace gpumem {

void check_release_threshold(double share) {
  if (!(share >= 0.0 && share <= 1.0)) {
    throw LimitSpecError("gpumem: bad release threshold " + std::to_string(share) +
                         ": expected a share of the limit in (0, 1], or 0 to turn it off");
  }
}

DeviceAllocator::DeviceAllocator(Backend& backend, int device, const AllocatorConfig& config)
    : d_(backend, device, this),
      plain_(d_),
      growable_(d_, plain_, config.growable),
      release_threshold_(0.0) {
  d_.device_total = d_.backend.total_memory(device);
  check_release_threshold(config.release_threshold);
  if (config.limit && *config.limit > d_.device_total) {
    throw LimitSpecError("gpumem: limit of " + format_bytes(*config.limit) + " is above device " +
                         std::to_string(device) + "'s total of " + format_bytes(d_.device_total));
  }
  d_.cap.set_limit(config.limit.value_or(d_.device_total));
  scope_ = config.scope;  // measured at the first growth: the backend is not asked yet
  release_threshold_ = config.release_threshold;
  growable_.set_page_size(d_.backend.page_size(device));  // the backend is asked once the config holds
}

DeviceAllocator::~DeviceAllocator() {
  // The owner is going away: give everything back, live blocks included. A destructor must not
  // throw (it would end the process): a backend call that fails now leaves that memory to the
  // driver, which frees it with the process.
  for (const PendingFree& p : pending_) quietly([&] { d_.backend.destroy_event(d_.device, p.event); });
  for (const auto& [addr, bytes] : uncached_) {
    quietly([&] { d_.backend.release(d_.device, reinterpret_cast<void*>(addr), bytes); });
  }
  for (const auto& [addr, segment] : d_.segments) memory_of(*segment).drop(*segment);
}

// ---- malloc: the fallback chain ----

// The cached path of a stream with a lane: what the chain below does when a cached block fits and
// no capture or pending event is in the way (the lane is open), under the stream's lane only. What
// opens the lane changes only under the whole device.
[[gnu::always_inline]] inline Block* DeviceAllocator::malloc_in_lane(LaneSlot& slot, std::size_t size,
                                                                     std::size_t requested) {
  LaneGuard guard(*slot.lane);
  Lane& lane = guard.lane();
  if (!lane.malloc_open) return nullptr;
  lane.arena.keep_one();  // a cut's Block: if that allocation fails, nothing has changed yet
  FreeBins* bins = lane_bins(slot, is_small(size));
  if (!bins) return nullptr;
  Block* block = FreeBlocks::take_best_fit_in(*bins, size);
  if (!block) return nullptr;
  ++lane.served;
  const InLane in_lane{bins, lane};
  block = place(block, size, requested, &in_lane);
  debug_check_lane(lane);
  return block;
}

Block* DeviceAllocator::malloc(std::size_t requested, StreamId stream, std::size_t at_least) {
  // No device holds this much; refusing here also keeps the rounding from overflowing.
  if (requested > SIZE_MAX - kLargeRounding) {
    const WholeDevice whole(*this);
    throw_oom(requested, requested);
  }
  const std::size_t size = std::max(round_size(requested), at_least);
  if (LaneSlot* slot = d_.lanes.slot_of(stream)) {
    if (Block* block = malloc_in_lane(*slot, size, requested)) return block;
  }
  return malloc_on_device(size, requested, stream);
}

[[gnu::noinline]] Block* DeviceAllocator::malloc_on_device(std::size_t size, std::size_t requested, StreamId stream) {
  const WholeDevice whole(*this);
  d_.lanes.add_stream(stream);  // before the stream's first block: its blocks' home is its lane's arena
  // While a graph may be capturing, event queries are illegal; blocks wait until it ends, or
  // until the capture graph shows they may be reused (core/capture_reuse.cpp).
  if (!d_.capturing()) {
    if (!pending_.empty()) process_events();
  } else if (capture_reuse_ && !deferred_.empty()) {
    reuse_deferred(stream);
  }
  Request r{&pool_for_locked(stream), is_small(size), stream, size};

  d_.arena_for(stream).keep_one();  // as in the lanes: before a cached block leaves the free set
  Block* block = try_cached(*r.pool, r);
  if (block) return place(block, size, requested, nullptr);
  measure_outside_locked();
  if (!fits_under(allocated_locked(), size, d_.cap.budget())) throw_oom(requested, size);
  block = memory_for(*r.pool).grow(r);
  if (!block && r.pool == &d_.default_pool) block = try_use_on_oom_pools(r);
  bool retried = false;
  if (!block && release_for(r)) {
    retried = true;
    block = memory_for(*r.pool).grow(r);
  }
  if (!block && !d_.capturing()) {
    retried = true;
    synchronize_and_process_events();
    release_all_unused();
    block = try_cached(*r.pool, r);
    if (!block) block = memory_for(*r.pool).grow(r);
  }
  if (retried) ++d_.stats.num_alloc_retries;
  if (!block) throw_oom(requested, size, r.device_refused);
  block = place(block, size, requested, nullptr);
  if (release_threshold_ > 0.0) apply_release_threshold();
  return block;
}

LaneGates DeviceAllocator::lane_gates() const {
  const bool capturing = d_.capturing();
  return {!capturing && pending_.empty() && !d_.stats.any_pending(),
          !capturing && release_threshold_ == 0.0 && d_.cap.reserved() <= d_.cap.budget()};
}

FreeBins* DeviceAllocator::find_lane_bins(LaneSlot& slot, bool small) {
  FreeBins* bins = d_.default_pool.blocks_for(small).existing_bins(slot.stream);
  slot.bins[small ? 0 : 1] = bins;
  return bins;
}

std::size_t DeviceAllocator::allocated_locked() const {
  return static_cast<std::size_t>(d_.stats.allocated_bytes()) + uncached_bytes_;
}

Pool& DeviceAllocator::targeted_pool_locked(StreamId stream) {
  for (auto it = d_.targets.rbegin(); it != d_.targets.rend(); ++it) {
    if (it->filter(stream)) return *it->pool;
  }
  return d_.default_pool;
}

// Hands out the front of `block`, returning the rest to the pool where the block is worth cutting
// (cuts()), and counts the hand-out: the one rule for it, on either path.
// Inline in malloc: it runs on every allocation.
[[gnu::always_inline]] inline Block* DeviceAllocator::place(Block* block, std::size_t size, std::size_t requested,
                                                            const InLane* lane) {
  const Segment& segment = *block->segment;
  const bool small = segment.small;
  const bool cut = cuts(*block, size);
  const SplitChange split = split_change_of(*block, size, cut);
  if (cut) {
    Block* rest = split_block(block, size, lane ? lane->lane.arena : d_.arena_for(segment.stream));
    if (lane) {
      FreeBlocks::insert_into(*lane->bins, rest);
    } else {
      segment.pool->blocks_for(small).insert(rest);
    }
  }
  block->allocated = true;
  block->requested = requested;
  {
    LedgerGuard ledger(d_.lanes, lane != nullptr);
    count_split(segment, split.blocks, split.bytes);
    d_.stats.hand_out(small, block->size, requested);
  }
  if (!lane) debug_check();
  return block;
}

void DeviceAllocator::throw_oom(std::size_t requested, std::size_t size, bool device_refused) {
  ++d_.stats.num_ooms;
  OomInfo info;
  info.device = d_.device;
  info.requested = requested;
  info.allocated = allocated_locked();
  info.reserved = d_.cap.reserved();
  info.limit = d_.cap.limit();
  info.process_scope = scope_ == LimitScope::kProcess;
  info.outside = d_.cap.outside();
  const MemInfo mem = d_.backend.mem_info(d_.device);
  info.device_free = mem.free;
  info.device_total = mem.total;
  info.largest_free_block = largest_free_block_locked();
  if (device_refused) {
    info.kind = OomKind::kDeviceFull;
    ++d_.stats.num_ooms_device_full;
  } else if (!fits_under(info.allocated, size, d_.cap.budget())) {
    info.kind = OomKind::kOverLimit;
    ++d_.stats.num_ooms_over_limit;
  } else {
    info.kind = OomKind::kFragmentation;
    ++d_.stats.num_ooms_fragmentation;
  }
  throw OutOfMemoryError(info);
}

// ---- free ----

// The cached free of a stream with a lane: a block no other stream used, of the default pool,
// while the lane is open (no capture, the limit not passed, no release threshold: nothing asks for
// more than the free set).
[[gnu::always_inline]] inline bool DeviceAllocator::free_in_lane(LaneSlot& slot, Block* block) {
  LaneGuard guard(*slot.lane);
  Lane& lane = guard.lane();
  if (!lane.free_open || !block->allocated || !block->stream_uses.empty()) return false;
  const Segment& segment = *block->segment;
  if (segment.pool != &d_.default_pool) return false;
  FreeBins* bins = lane_bins(slot, segment.small);
  if (!bins) return false;
  block->allocated = false;
  ++lane.served;
  const InLane in_lane{bins, lane};
  free_block(block, &in_lane, true);
  debug_check_lane(lane);
  return true;
}

void DeviceAllocator::free(Block* block) {
  if (LaneSlot* slot = d_.lanes.slot_of(block->stream); slot && free_in_lane(*slot, block)) return;
  free_on_device(block);
}

[[gnu::noinline]] void DeviceAllocator::free_on_device(Block* block) {
  const WholeDevice whole(*this);
  if (!block->allocated) throw std::logic_error("gpumem: block freed twice or never allocated");
  block->allocated = false;
  if (block->stream_uses.empty()) {
    release_after_free(free_block(block, nullptr, true));
    debug_check();
    return;
  }
  const bool small = block->segment->small;
  d_.stats.release(small, block->size);
  d_.stats.pend(small, block->size);
  if (!d_.capturing()) {
    insert_events(block);
  } else {
    defer(block);
  }
  debug_check();
}

void DeviceAllocator::free_pending(Block* block) {
  block->pending_events = 0;
  d_.stats.retire(block->segment->small, block->size);
  release_after_free(free_block(block, nullptr, false));
}

// Back into the free set, merged with its free neighbours, and counted: the one rule for a free,
// on either path.
[[gnu::always_inline]] inline Block* DeviceAllocator::free_block(Block* block, const InLane* lane, bool released) {
  const Segment& segment = *block->segment;  // `block` itself may be folded into its neighbour
  const bool small = segment.small;
  const std::size_t size = block->size;
  const std::size_t requested = block->requested;
  block->requested = 0;
  FreeBlocks& blocks = segment.pool->blocks_for(small);
  const Merge merge = merge_free_neighbours(block, blocks, lane ? lane->lane.arena : d_.arena_for(segment.stream));
  const bool split = merge.block->is_split();  // the net change: the merged block if split, less the neighbours
  const std::int64_t split_blocks = (split ? 1 : 0) - merge.absorbed_count;
  const std::int64_t split_bytes =
      static_cast<std::int64_t>(split ? merge.block->size : 0) - static_cast<std::int64_t>(merge.absorbed_bytes);
  if (lane) {
    FreeBlocks::insert_into(*lane->bins, merge.block);
  } else {
    blocks.insert(merge.block);
  }
  LedgerGuard ledger(d_.lanes, lane != nullptr);
  if (released) d_.stats.release(small, size);
  d_.stats.settle(small, requested);
  count_split(segment, split_blocks, split_bytes);
  return merge.block;
}

void DeviceAllocator::release_after_free(const Block* merged) {
  // Usually neither holds, and the free ends here.
  const bool over_limit = d_.cap.reserved() > d_.cap.budget() && !d_.capturing();
  if (!over_limit && release_threshold_ == 0.0) return;
  // Something became releasable: a whole plain segment, or a free page of a growable one.
  if (!memory_of(*merged->segment).frees_memory(*merged)) return;
  if (over_limit) give_back_over_limit();
  if (release_threshold_ > 0.0) apply_release_threshold();
}

void DeviceAllocator::record_stream(Block* block, StreamId stream) {
  const WholeDevice whole(*this);
  if (stream == block->stream) return;
  auto& uses = block->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

// ---- stream events ----

void DeviceAllocator::insert_events(Block* block) {
  block->pending_events = static_cast<int>(block->stream_uses.size());
  for (StreamId s : block->stream_uses) pending_.push_back({block, d_.backend.record_event(d_.device, s)});
  block->stream_uses.clear();
}

// The queue is settled before any block is freed: freeing may release memory (the release
// threshold), and a release that throws must not leave done events in the queue. A block keeps
// its last pending event until it is freed, so that a neighbour freed first does not merge it.
void DeviceAllocator::process_events() {
  if (pending_.empty()) return;
  std::vector<Block*> done;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    PendingFree p = pending_[i];
    if (!d_.backend.event_done(d_.device, p.event)) {
      pending_[kept++] = p;
      continue;
    }
    d_.backend.destroy_event(d_.device, p.event);
    if (p.block->pending_events == 1) {
      done.push_back(p.block);
    } else {
      --p.block->pending_events;
    }
  }
  pending_.resize(kept);
  for (Block* block : done) free_pending(block);
}

// Counted whether or not anything is pending: see Note [what num_sync_all_streams counts] (core/release.cpp).
void DeviceAllocator::synchronize_and_process_events() {
  ++d_.stats.num_sync_all_streams;
  if (pending_.empty()) return;
  d_.backend.synchronize(d_.device);
  process_events();
}

// ---- growable segments: asked for, and in effect ----

void DeviceAllocator::set_growable(bool on) {
  const WholeDevice whole(*this);
  growable_.set_on(on);
}

bool DeviceAllocator::growable() const {
  const WholeDevice whole(*this);
  return growable_.in_effect();
}

// ---- statistics and views ----

DeviceStats DeviceAllocator::stats() const {
  const WholeDevice whole(*this);
  return d_.stats.snapshot();
}

std::uint64_t DeviceAllocator::served_in_lanes() const {
  const WholeDevice whole(*this);
  return d_.lanes.served();
}

std::size_t DeviceAllocator::blocks_made() const {
  const WholeDevice whole(*this);
  std::size_t made = 0;
  d_.lanes.for_each_arena([&](const BlockArena& arena, int) { made += arena.made(); });
  return made;
}

void DeviceAllocator::reset_peak_stats() {
  const WholeDevice whole(*this);
  d_.stats.reset_peak();
}

void DeviceAllocator::reset_accumulated_stats() {
  const WholeDevice whole(*this);
  d_.stats.reset_accumulated();
}

std::size_t DeviceAllocator::largest_free_block_locked() const {
  std::size_t largest = gpumem::largest_free_block(d_.default_pool);
  for (const auto& [id, pool] : private_pools_) largest = std::max(largest, gpumem::largest_free_block(*pool));
  return largest;
}

std::size_t DeviceAllocator::largest_free_block() const {
  const WholeDevice whole(*this);
  return largest_free_block_locked();
}

MemInfo DeviceAllocator::device_mem_info() { return d_.backend.mem_info(d_.device); }

namespace {

BlockInfo info_of(const Block& b) {
  const auto state = b.allocated ? BlockInfo::kAllocated : (b.pending_events > 0 ? BlockInfo::kPendingFree : BlockInfo::kFree);
  return {b.addr, b.size, b.requested, state};
}

}  // namespace

// A plain segment is one SegmentInfo; a growable one, one per mapped stretch, so the segments of a
// snapshot add up to the reserved bytes.
std::vector<SegmentInfo> DeviceAllocator::snapshot() const {
  const WholeDevice whole(*this);
  std::vector<SegmentInfo> out;
  out.reserve(d_.segments.size());
  for (const auto& [addr, segment] : d_.segments) {
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
  const WholeDevice whole(*this);
  auto it = d_.segments.upper_bound(addr);
  if (it == d_.segments.begin()) return std::nullopt;
  const Segment& s = *std::prev(it)->second;
  if (addr >= s.addr + s.size) return std::nullopt;
  if (!s.growable) return std::make_pair(s.addr, s.size);
  std::optional<std::pair<std::uintptr_t, std::size_t>> stretch;  // the mapped stretch holding `addr`
  for_each_stretch(s, [&](const Block* first, const Block*, std::uintptr_t stop) {
    if (addr >= first->addr && addr < stop) stretch = std::make_pair(first->addr, stop - first->addr);
  });
  return stretch;
}

bool DeviceAllocator::heads_a_split(const Block* block) const {
  const WholeDevice whole(*this);
  const bool starts = block->prev == nullptr || !block->prev->mapped;
  // Free mapped neighbours always merge, so a cached block right behind is the rest of a split.
  return starts && block->next != nullptr && block->next->is_cached();
}

// ---- invariants ----

void DeviceAllocator::check_invariants() const {
  const WholeDevice whole(*this);
  check_invariants_locked();
}

}  // namespace gpumem
