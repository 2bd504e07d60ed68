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
  mutex_.attach(&d_.stats, &DeviceAllocator::lane_gates, this);
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
// opens the lane changes only under the whole device. What the hand-out adds to the statistics
// must fit in the lane's room below the peaks (LaneStats); where it might not, the block goes back
// and the whole device serves the request.
[[gnu::always_inline]] inline Block* DeviceAllocator::malloc_in_lane(LaneSlot& slot, std::size_t requested,
                                                                     std::size_t at_least) {
  LaneGuard guard(mutex_, *slot.lane);
  Lane& lane = guard.lane();
  if (!lane.malloc_open || requested > SIZE_MAX - kLargeRounding) return nullptr;
  lane.arena.keep_one();  // a cut's Block: if that allocation fails, nothing has changed yet
  const std::size_t size = std::max(round_size(requested), at_least);
  FreeBins* bins = lane_bins(slot, is_small(size));
  if (!bins) return nullptr;
  Block* block = FreeBlocks::take_best_fit_in(*bins, size);
  if (!block) return nullptr;
  const Segment& segment = *block->segment;
  // What it adds, as place() will do it: the block handed out, cut to `size` or whole, and where the
  // cut leaves a new inactive split block (counted in plain segments only), that block; the other
  // changes to the inactive split blocks are decreases, which always fit.
  const bool cut = cuts(*block, size);
  const SplitChange split = split_change_of(*block, size, cut);
  const std::size_t new_split = split.blocks > 0 && !segment.growable ? static_cast<std::size_t>(split.bytes) : 0;
  if (!lane.stats.hand_out_fits(segment.small ? 0 : 1, cut ? size : block->size, requested, new_split)) {
    FreeBlocks::insert_into(*bins, block);
    lane.wanted = true;
    return nullptr;
  }
  ++lane.served;
  const InLane in_lane{bins, lane};
  return place(block, size, requested, cut, split, &in_lane);
}

Block* DeviceAllocator::malloc(std::size_t requested, StreamId stream, std::size_t at_least) {
  if (LaneSlot* slot = mutex_.slot_of(stream)) {
    if (Block* block = malloc_in_lane(*slot, requested, at_least)) return block;
  }
  return malloc_on_device(requested, stream, at_least);
}

[[gnu::noinline]] Block* DeviceAllocator::malloc_on_device(std::size_t requested, StreamId stream,
                                                           std::size_t at_least) {
  std::lock_guard<DeviceLock> lock(mutex_);
  mutex_.add_stream(stream);
  // While a graph may be capturing, event queries are illegal; blocks wait until it ends, or
  // until the capture graph shows they may be reused (core/capture_reuse.cpp).
  if (!d_.capturing()) {
    if (!pending_.empty()) process_events();
  } else if (capture_reuse_ && !deferred_.empty()) {
    reuse_deferred(stream);
  }
  // No device holds this much; failing here also keeps the rounding below from overflowing.
  if (requested > SIZE_MAX - kLargeRounding) throw_oom(requested, requested);
  const std::size_t size = std::max(round_size(requested), at_least);
  Request r{&pool_for_locked(stream), is_small(size), stream, size};

  d_.arena.keep_one();  // as in the lanes: before a cached block leaves the free set
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

LaneGates DeviceAllocator::lane_gates(const void* self) {
  const auto& a = *static_cast<const DeviceAllocator*>(self);
  const bool capturing = a.d_.capturing();
  return {!capturing && a.pending_.empty() && !a.d_.stats.any_pending(),
          !capturing && a.release_threshold_ == 0.0 && a.d_.cap.reserved() <= a.d_.cap.budget()};
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

// Hands out the front of `block`, returning the rest to the pool where `cut` (cuts(): the rest is
// worth keeping and the pool splits blocks); the inactive split blocks change by `split`
// (split_change_of, found before the cut).
// Inline in malloc: it runs on every allocation.
[[gnu::always_inline]] inline Block* DeviceAllocator::place(Block* block, std::size_t size, std::size_t requested,
                                                            bool cut, SplitChange split, const InLane* lane) {
  const Segment& segment = *block->segment;
  const bool small = segment.small;
  if (cut) {
    Block* rest = split_block(block, size, lane ? lane->lane.arena : d_.arena);
    if (lane) {
      FreeBlocks::insert_into(*lane->bins, rest);
    } else {
      segment.pool->blocks_for(small).insert(rest);
    }
  }
  block->allocated = true;
  block->requested = requested;
  if (lane) {
    count_split(lane->lane.stats, segment, split.blocks, split.bytes);
    lane->lane.stats.hand_out(small ? 0 : 1, block->size, requested);
  } else {
    count_split(segment, split.blocks, split.bytes);
    d_.stats.hand_out(small, block->size, requested);
  }
  debug_check();
  return block;
}

[[gnu::always_inline]] inline Block* DeviceAllocator::place(Block* block, std::size_t size, std::size_t requested,
                                                            const InLane* lane) {
  const bool cut = cuts(*block, size);
  return place(block, size, requested, cut, split_change_of(*block, size, cut), lane);
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
// more than the free set), and the most the free can add to the inactive split blocks (for a split
// block, its own size, and one block unless it joins a free neighbour) fits in the lane's room.
[[gnu::always_inline]] inline bool DeviceAllocator::free_in_lane(LaneSlot& slot, Block* block) {
  LaneGuard guard(mutex_, *slot.lane);
  Lane& lane = guard.lane();
  if (!lane.free_open || !block->allocated || !block->stream_uses.empty()) return false;
  const Segment& segment = *block->segment;
  if (segment.pool != &d_.default_pool) return false;
  // An unsplit block is its whole segment: its free adds no inactive split block.
  if (!segment.growable && block->is_split() &&
      !lane.stats.free_fits(segment.small ? 0 : 1, block->size, joins_a_free_neighbour(block))) {
    lane.wanted = true;
    return false;
  }
  FreeBins* bins = lane_bins(slot, segment.small);
  if (!bins) return false;
  block->allocated = false;
  ++lane.served;
  const InLane in_lane{bins, lane};
  free_block(block, &in_lane, true);
  debug_check();
  return true;
}

void DeviceAllocator::free(Block* block) {
  if (LaneSlot* slot = mutex_.slot_of(block->stream); slot && free_in_lane(*slot, block)) return;
  free_on_device(block);
}

[[gnu::noinline]] void DeviceAllocator::free_on_device(Block* block) {
  std::lock_guard<DeviceLock> lock(mutex_);
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

[[gnu::always_inline]] inline Block* DeviceAllocator::free_block(Block* block, const InLane* lane, bool released) {
  const Segment& segment = *block->segment;  // `block` itself may be folded into its neighbour
  const bool small = segment.small;
  const std::size_t size = block->size;
  const std::size_t requested = block->requested;
  block->requested = 0;
  FreeBlocks& blocks = segment.pool->blocks_for(small);
  const Merge merge = merge_free_neighbours(block, blocks, lane ? lane->lane.arena : d_.arena);
  const bool split = merge.block->is_split();  // the net change: the merged block if split, less the neighbours
  const std::int64_t split_blocks = (split ? 1 : 0) - merge.absorbed_count;
  const std::int64_t split_bytes =
      static_cast<std::int64_t>(split ? merge.block->size : 0) - static_cast<std::int64_t>(merge.absorbed_bytes);
  if (lane) {
    FreeBlocks::insert_into(*lane->bins, merge.block);
    LaneStats& stats = lane->lane.stats;
    if (released) stats.release(small ? 0 : 1, size);
    stats.settle(small ? 0 : 1, requested);
    count_split(stats, segment, split_blocks, split_bytes);
  } else {
    blocks.insert(merge.block);
    if (released) d_.stats.release(small, size);
    d_.stats.settle(small, requested);
    count_split(segment, split_blocks, split_bytes);
  }
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
  std::lock_guard<DeviceLock> lock(mutex_);
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

void DeviceAllocator::synchronize_and_process_events() {
  if (pending_.empty()) return;
  d_.backend.synchronize(d_.device);
  ++d_.stats.num_sync_all_streams;
  process_events();
}

// ---- growable segments: asked for, and in effect ----

void DeviceAllocator::set_growable(bool on) {
  std::lock_guard<DeviceLock> lock(mutex_);
  growable_.set_on(on);
}

bool DeviceAllocator::growable() const {
  std::lock_guard<DeviceLock> lock(mutex_);
  return growable_.in_effect();
}

// ---- statistics and views ----

DeviceStats DeviceAllocator::stats() const {
  std::lock_guard<DeviceLock> lock(mutex_);
  return d_.stats.snapshot();
}

std::uint64_t DeviceAllocator::served_in_lanes() const {
  std::lock_guard<DeviceLock> lock(mutex_);
  return mutex_.served();
}

void DeviceAllocator::reset_peak_stats() {
  std::lock_guard<DeviceLock> lock(mutex_);
  d_.stats.reset_peak();
}

void DeviceAllocator::reset_accumulated_stats() {
  std::lock_guard<DeviceLock> lock(mutex_);
  d_.stats.reset_accumulated();
}

std::size_t DeviceAllocator::largest_free_block_locked() const {
  std::size_t largest = gpumem::largest_free_block(d_.default_pool);
  for (const auto& [id, pool] : private_pools_) largest = std::max(largest, gpumem::largest_free_block(*pool));
  return largest;
}

std::size_t DeviceAllocator::largest_free_block() const {
  std::lock_guard<DeviceLock> lock(mutex_);
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
  std::lock_guard<DeviceLock> lock(mutex_);
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
  std::lock_guard<DeviceLock> lock(mutex_);
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
  std::lock_guard<DeviceLock> lock(mutex_);
  const bool starts = block->prev == nullptr || !block->prev->mapped;
  // Free mapped neighbours always merge, so a cached block right behind is the rest of a split.
  return starts && block->next != nullptr && block->next->is_cached();
}

// ---- invariants ----

void DeviceAllocator::check_invariants() const {
  std::lock_guard<DeviceLock> lock(mutex_);
  check_invariants_locked();
}

}  // namespace gpumem
