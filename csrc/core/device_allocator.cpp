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

namespace {

// Calls f(first, end, stop) for each mapped stretch of `segment`: its first block, the block after
// it (nullptr at the segment's end) and the address it stops at. A plain segment is one stretch.
// Unmapped blocks are whole pages, so in a growable segment a stretch is whole pages too.
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

}  // namespace

DeviceAllocator::DeviceAllocator(Backend& backend, int device, const AllocatorConfig& config)
    : backend_(backend), device_(device), backend_source_(backend, device), cap_(0), release_threshold_(0.0) {
  device_total_ = backend_.total_memory(device);
  check_release_threshold(config.release_threshold);
  if (config.limit && *config.limit > device_total_) {
    throw LimitSpecError("gpumem: limit of " + format_bytes(*config.limit) + " is above device " +
                         std::to_string(device) + "'s total of " + format_bytes(device_total_));
  }
  cap_.set_limit(config.limit.value_or(device_total_));
  scope_ = config.scope;  // measured at the first growth: the backend is not asked yet
  release_threshold_ = config.release_threshold;
  page_size_ = backend_.page_size(device);
  growable_ = config.growable;
}

DeviceAllocator::~DeviceAllocator() {
  // The owner is going away: give everything back, live blocks included. A destructor must not
  // throw (it would end the process): a backend call that fails now leaves that memory to the
  // driver, which frees it with the process.
  for (const PendingFree& p : pending_) quietly([&] { backend_.destroy_event(device_, p.event); });
  for (const auto& [addr, bytes] : uncached_) {
    quietly([&] { backend_.release(device_, reinterpret_cast<void*>(addr), bytes); });
  }
  for (auto& [addr, segment] : segments_) {
    if (!segment->growable) {
      quietly([&] { segment->source->release(segment->head->ptr(), segment->size); });
      continue;
    }
    for_each_stretch(*segment, [&](const Block* first, const Block*, std::uintptr_t stop) {
      quietly([&] { backend_.unmap(device_, first->ptr(), stop - first->addr); });
    });
    quietly([&] { backend_.release_address(device_, segment->head->ptr(), segment->size); });
  }
}

// ---- malloc: the fallback chain ----

Block* DeviceAllocator::malloc(std::size_t requested, StreamId stream, std::size_t at_least) {
  std::lock_guard<Lock> lock(mutex_);
  // While a graph may be capturing, event queries are illegal; blocks wait until it ends, or
  // until the capture graph shows they may be reused (core/capture_reuse.cpp).
  if (pool_targets_.empty()) {
    process_events();
  } else if (capture_reuse_ && !deferred_.empty()) {
    reuse_deferred(stream);
  }
  // No device holds this much; failing here also keeps the rounding below from overflowing.
  if (requested > SIZE_MAX - kLargeRounding) throw_oom(requested, requested);
  const std::size_t size = std::max(round_size(requested), at_least);
  Request r{&pool_for_locked(stream), is_small(size), stream, size};

  Block* block = try_cached(*r.pool, r);
  if (block) return place(block, size, requested);
  measure_outside_locked();
  if (!fits_under(allocated_locked(), size, cap_.budget())) throw_oom(requested, size);
  block = try_new_memory(r);
  if (!block && r.pool == &default_pool_) block = try_use_on_oom_pools(r);
  bool retried = false;
  if (!block && release_for(r)) {
    retried = true;
    block = try_new_memory(r);
  }
  if (!block && pool_targets_.empty()) {
    retried = true;
    synchronize_and_process_events();
    release_all_unused();
    block = try_cached(*r.pool, r);
    if (!block) block = try_new_memory(r);
  }
  if (retried) ++stats_.num_alloc_retries;
  if (!block) throw_oom(requested, size, r.device_refused);
  block = place(block, size, requested);
  if (release_threshold_ > 0.0) apply_release_threshold();
  return block;
}

std::size_t DeviceAllocator::allocated_locked() const {
  return static_cast<std::size_t>(stats_.allocated_bytes()) + uncached_bytes_;
}

Pool& DeviceAllocator::targeted_pool_locked(StreamId stream) {
  for (auto it = pool_targets_.rbegin(); it != pool_targets_.rend(); ++it) {
    if (it->filter(stream)) return *it->pool;
  }
  return default_pool_;
}

// A cached free block of `pool` for the request (its class, stream and size), or nullptr.
Block* DeviceAllocator::try_cached(Pool& pool, const Request& r) {
  Block* block = pool.blocks_for(r.small).take_best_fit(r.stream, r.size);
  if (block && block->is_split()) stats_.absorb(r.small, block->size);
  return block;
}

Block* DeviceAllocator::try_new_segment(Request& r) {
  const std::size_t normal = segment_size(r.size);
  if (Block* block = reserve_segment(r, normal)) return block;
  const std::size_t tight = tight_segment_size(r.size);
  return tight == normal ? nullptr : reserve_segment(r, tight);
}

// The cap first, then the pool's source (the backend, or a MemPool's allocator); the cap is given
// back if the source refuses or throws.
Block* DeviceAllocator::reserve_segment(Request& r, std::size_t bytes) {
  void* ptr = capped_for(r, bytes, [&] { return source_of(*r.pool).reserve(bytes); });
  if (!ptr) return nullptr;
  if (overlaps_segment(reinterpret_cast<std::uintptr_t>(ptr), bytes)) {
    cap_.unreserve(bytes);  // the memory is not the allocator's: it cannot be given back either
    throw_overlap("reserve", ptr, bytes);
  }
  Segment* segment = add_segment(*r.pool, r.small, r.stream, reinterpret_cast<std::uintptr_t>(ptr), bytes);
  segment->mapped = bytes;
  stats_.reserve(r.small, bytes, 1);
  ++stats_.num_device_alloc;
  reserved_high_ = std::max(reserved_high_, cap_.reserved());
  return segment->head;
}

// New memory for the pool: pages of a growable segment where the pool uses them, else a segment.
Block* DeviceAllocator::try_new_memory(Request& r) {
  return uses_growable(*r.pool) ? try_grow(r) : try_new_segment(r);
}

// A backend that hands out memory the allocator already holds is broken; going on would corrupt
// the segment table, so the request fails instead (a RuntimeError in Python).
bool DeviceAllocator::overlaps_segment(std::uintptr_t addr, std::size_t size) const {
  auto after = segments_.lower_bound(addr);
  if (after != segments_.end() && after->first - addr < size) return true;
  if (after == segments_.begin()) return false;
  const Segment& before = *std::prev(after)->second;
  return addr - before.addr < before.size;
}

void DeviceAllocator::throw_overlap(const char* call, const void* ptr, std::size_t size) const {
  throw std::logic_error("gpumem: device " + std::to_string(device_) + "'s " + call + " handed out " +
                         std::to_string(size) + " bytes at " + std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
                         ", which overlap memory the allocator already holds; the backend is broken");
}

// Files a segment of [addr, addr + size) under the pool, as one block; statistics are the caller's.
Segment* DeviceAllocator::add_segment(Pool& pool, bool small, StreamId stream, std::uintptr_t addr, std::size_t size) {
  auto segment = std::make_unique<Segment>();
  segment->addr = addr;
  segment->size = size;
  segment->stream = stream;
  segment->pool = &pool;
  segment->small = small;
  segment->serial = next_serial_++;
  segment->source = &source_of(pool);
  segment->owner = this;
  Block* head = arena_.make();
  head->addr = addr;
  head->size = size;
  head->stream = stream;
  head->segment = segment.get();
  segment->head = head;
  ++pool.segments;
  return segments_.emplace(addr, std::move(segment)).first->second.get();
}

// Hands out the front of `block`, returning the rest to the pool when it is worth keeping and the
// pool splits blocks. The pool's no_split is read only when a split is due, so the common path of
// an exact or near fit reads nothing more than before.
Block* DeviceAllocator::place(Block* block, std::size_t size, std::size_t requested) {
  const bool small = block->segment->small;
  if (should_split(block->size, size) && !block->segment->pool->no_split) {
    Block* rest = split_block(block, size, arena_);
    block->segment->pool->blocks_for(small).insert(rest);
    stats_.split(small, rest->size);
  }
  block->allocated = true;
  block->requested = requested;
  stats_.hand_out(small, block->size, requested);
  debug_check();
  return block;
}

void DeviceAllocator::throw_oom(std::size_t requested, std::size_t size, bool device_refused) {
  ++stats_.num_ooms;
  OomInfo info;
  info.device = device_;
  info.requested = requested;
  info.allocated = allocated_locked();
  info.reserved = cap_.reserved();
  info.limit = cap_.limit();
  info.process_scope = scope_ == LimitScope::kProcess;
  info.outside = cap_.outside();
  const MemInfo mem = backend_.mem_info(device_);
  info.device_free = mem.free;
  info.device_total = mem.total;
  info.largest_free_block = largest_free_block_locked();
  if (device_refused) {
    info.kind = OomKind::kDeviceFull;
    ++stats_.num_ooms_device_full;
  } else if (!fits_under(info.allocated, size, cap_.budget())) {
    info.kind = OomKind::kOverLimit;
    ++stats_.num_ooms_over_limit;
  } else {
    info.kind = OomKind::kFragmentation;
    ++stats_.num_ooms_fragmentation;
  }
  throw OutOfMemoryError(info);
}

// ---- free ----

void DeviceAllocator::free(Block* block) {
  std::lock_guard<Lock> lock(mutex_);
  if (!block->allocated) throw std::logic_error("gpumem: block freed twice or never allocated");
  const bool small = block->segment->small;
  block->allocated = false;
  stats_.release(small, block->size, block->requested);
  block->requested = 0;
  if (block->stream_uses.empty()) {
    free_block(block);
  } else if (pool_targets_.empty()) {
    insert_events(block);
  } else {
    defer(block);
  }
  debug_check();
}

void DeviceAllocator::free_block(Block* block) {
  const bool small = block->segment->small;
  stats_.retire(small, block->size);
  FreeBlocks& blocks = block->segment->pool->blocks_for(small);
  const Merge merge = merge_free_neighbours(block, blocks, arena_);
  for (int i = 0; i < merge.absorbed_count; ++i) stats_.absorb(small, merge.absorbed[i]);
  if (merge.block->is_split()) stats_.split(small, merge.block->size);
  blocks.insert(merge.block);
  // Usually neither holds, and the free ends here.
  const bool over_limit = cap_.reserved() > cap_.budget() && pool_targets_.empty();
  if (!over_limit && release_threshold_ == 0.0) return;
  // Something became releasable: a whole plain segment, or a free page of a growable one.
  if (!merge.block->segment->is_unused() && !holds_free_page(merge.block)) return;
  if (over_limit) release_oldest_until(cap_.budget());  // Note [reserved above a lowered limit]
  if (release_threshold_ > 0.0) apply_release_threshold();
}

void DeviceAllocator::record_stream(Block* block, StreamId stream) {
  std::lock_guard<Lock> lock(mutex_);
  if (stream == block->stream) return;
  auto& uses = block->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

// ---- stream events ----

void DeviceAllocator::insert_events(Block* block) {
  block->pending_events = static_cast<int>(block->stream_uses.size());
  for (StreamId s : block->stream_uses) pending_.push_back({block, backend_.record_event(device_, s)});
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
    if (!backend_.event_done(device_, p.event)) {
      pending_[kept++] = p;
      continue;
    }
    backend_.destroy_event(device_, p.event);
    if (p.block->pending_events == 1) {
      done.push_back(p.block);
    } else {
      --p.block->pending_events;
    }
  }
  pending_.resize(kept);
  for (Block* block : done) {
    block->pending_events = 0;
    free_block(block);
  }
}

void DeviceAllocator::synchronize_and_process_events() {
  if (pending_.empty()) return;
  backend_.synchronize(device_);
  ++stats_.num_sync_all_streams;
  process_events();
}

// ---- statistics and views ----

DeviceStats DeviceAllocator::stats() const {
  std::lock_guard<Lock> lock(mutex_);
  return stats_.snapshot();
}

void DeviceAllocator::reset_peak_stats() {
  std::lock_guard<Lock> lock(mutex_);
  stats_.reset_peak();
}

void DeviceAllocator::reset_accumulated_stats() {
  std::lock_guard<Lock> lock(mutex_);
  stats_.reset_accumulated();
}

std::size_t DeviceAllocator::largest_free_block_locked() const {
  std::size_t largest = gpumem::largest_free_block(default_pool_);
  for (const auto& [id, pool] : private_pools_) largest = std::max(largest, gpumem::largest_free_block(*pool));
  return largest;
}

std::size_t DeviceAllocator::largest_free_block() const {
  std::lock_guard<Lock> lock(mutex_);
  return largest_free_block_locked();
}

MemInfo DeviceAllocator::device_mem_info() { return backend_.mem_info(device_); }

namespace {

BlockInfo info_of(const Block& b) {
  const auto state = b.allocated ? BlockInfo::kAllocated : (b.pending_events > 0 ? BlockInfo::kPendingFree : BlockInfo::kFree);
  return {b.addr, b.size, b.requested, state};
}

}  // namespace

// A plain segment is one SegmentInfo; a growable one, one per mapped stretch, so the segments of a
// snapshot add up to the reserved bytes.
std::vector<SegmentInfo> DeviceAllocator::snapshot() const {
  std::lock_guard<Lock> lock(mutex_);
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [addr, segment] : segments_) {
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
  std::lock_guard<Lock> lock(mutex_);
  auto it = segments_.upper_bound(addr);
  if (it == segments_.begin()) return std::nullopt;
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
  std::lock_guard<Lock> lock(mutex_);
  const bool starts = block->prev == nullptr || !block->prev->mapped;
  // Free mapped neighbours always merge, so a cached block right behind is the rest of a split.
  return starts && block->next != nullptr && block->next->is_cached();
}

// ---- invariants ----

void DeviceAllocator::check_invariants() const {
  std::lock_guard<Lock> lock(mutex_);
  check_invariants_locked();
}

void DeviceAllocator::debug_check() const {
#if GPUMEM_CHECK_INVARIANTS
  check_invariants_locked();
#endif
}

}  // namespace gpumem
