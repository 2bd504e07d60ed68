// The fallback chain of malloc, the free path and the lanes' cached paths: core/device_core.h.
#include "core/device_core.h"

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <unistd.h>
#include <vector>

#include "core/limit_spec.h"
#include "core/share_hooks.h"
#include "core/sizing.h"

namespace gpumem {

namespace {

// Plain segments released while it lives go to `departing`, and back to the backend later
// (DeviceCore::give_back), with no lock held.
struct Deferring {
  PlainSegments& plain;
  Deferring(PlainSegments& p, std::vector<Departure>* departing) : plain(p) { plain.defer_to(departing); }
  ~Deferring() { plain.defer_to(nullptr); }
  Deferring(const Deferring&) = delete;
  Deferring& operator=(const Deferring&) = delete;
};

// Whether handing out `size` bytes of free `block` cuts it: the rest is worth keeping and the pool
// splits blocks (its no_split is read only when a split is due).
bool cuts(const Block& block, std::size_t size) {
  return should_split(block.size, size) && !block.segment->pool->no_split();
}

// What handing out `size` bytes of free `block` (cut or not) does to the inactive split blocks,
// as native counts them: a split block that is cut gives the caller `size` bytes (it stays one
// inactive split block); an unsplit one that is cut leaves a new one, its rest; a split block
// handed out whole is one fewer.
struct SplitChange {
  std::int64_t blocks = 0;
  std::int64_t bytes = 0;
};
SplitChange split_change_of(const Block& block, std::size_t size, bool cut) {
  const bool was_split = block.is_split();
  if (cut) {
    return was_split ? SplitChange{0, -static_cast<std::int64_t>(size)}
                     : SplitChange{1, static_cast<std::int64_t>(block.size - size)};
  }
  return was_split ? SplitChange{-1, -static_cast<std::int64_t>(block.size)} : SplitChange{};
}

// Inactive split blocks changed in `segment`; counted in plain segments only (StatLedger::split_change).
void count_split(StatLedger& stats, const Segment& segment, std::int64_t blocks, std::int64_t bytes) {
  if (!segment.growable) stats.split_change(segment.small, blocks, bytes);
}

// A cached free block of `pool` for the request (its class, stream and size), or nullptr.
Block* try_cached(Pool& pool, const Request& r) { return pool.blocks_for(r.small).take_best_fit(r.stream, r.size); }

}  // namespace

void check_limit_fits(std::optional<std::size_t> limit, int device, std::size_t total) {
  if (!limit || *limit <= total) return;
  throw LimitSpecError({"limit", std::nullopt,
                        format_bytes(*limit) + " is above device " + std::to_string(device) + "'s total of " +
                            format_bytes(total),
                        kLimitForms, ""});
}

DeviceCore::DeviceCore(Backend& backend, int device, const AllocatorConfig& config, DeviceAllocator* owner)
    : d_(backend, device, owner),
      sources_(d_, config.growable, config.large_chunk),
      events_(backend, device),
      uncached_(backend, device),
      release_(d_, sources_, config.release_threshold),
      scope_(config.scope) {  // measured at the first growth: the backend is not asked yet
  d_.ask_device_total();
  check_limit_fits(config.limit, device, d_.device_total());
  d_.accounts.set_limit(config.limit.value_or(d_.device_total()));
  sources_.growable.set_page_size(d_.backend.page_size(device));  // the backend is asked once the config holds
}

DeviceCore::~DeviceCore() {
  // The owner is going away: give everything back, live blocks included. A destructor must not
  // throw (it would end the process): a backend call that fails now leaves that memory to the
  // driver, which frees it with the process. The events and uncached memory go with their owners.
  for (const auto& [addr, segment] : d_.segments) sources_.of(*segment).drop(*segment);
  for (auto& [id, backup] : backups_) d_.backend.drop_backup(d_.device, backup.held);
}

// ---- malloc: the fallback chain ----

// The cached path of a stream with a lane: what the chain below does when a cached block fits and
// no capture or pending event is in the way (the lane is open), under the stream's lane only. What
// opens the lane changes only under the whole device.
[[gnu::always_inline]] inline Block* DeviceCore::malloc_in_lane(LaneSlot& slot, std::size_t size,
                                                                std::size_t requested) {
  LaneGuard guard(*slot.lane);
  Lane& lane = guard.lane();
  if (!lane.malloc_open) return nullptr;
  lane.arena.keep_one();  // a cut's Block: if that allocation fails, nothing has changed yet
  FreeBins* bins = lane_bins(slot, is_small(size));
  if (!bins) return nullptr;
  Block* block = FreeBlocks::take_best_fit_in(*bins, size);
  if (!block) return nullptr;
  const InLane in_lane{bins, lane, d_.lane_ledgers.enter(d_.lanes, lane, d_.accounts.ledger())};
  block = place(block, size, requested, &in_lane);
  debug_check_lane(lane);
  return block;
}

Block* DeviceCore::malloc(std::size_t requested, StreamId stream, std::size_t at_least) {
  // No device holds this much; refusing here also keeps the rounding from overflowing.
  if (requested > SIZE_MAX - kLargeRounding) {
    const WholeDevice whole(*this);
    throw_oom(requested, requested);
  }
  const std::size_t size = std::max(round_size(requested), at_least);
  if (LaneSlot* slot = d_.lanes.slot_of(stream)) {
    if (Block* block = malloc_in_lane(*slot, size, requested)) return block;
  }
  return malloc_waiting(size, requested, stream);
}

// The chain under the whole device until it serves or throws. nullptr from it: memory on its way
// back to the device may make room (core/departures.h), or the other processes sharing the GPU may
// give some back: wait for it, or ask them, with no lock held, and try again. They are asked once a
// request: the second refusal is the request's error. Out of line, so that the cached path above
// keeps a small frame.
[[gnu::noinline]] Block* DeviceCore::malloc_waiting(std::size_t size, std::size_t requested, StreamId stream) {
  Asking asking;
  for (;;) {
    if (Block* block = malloc_on_device(size, requested, stream, asking)) return block;
    if (!ask_neighbours(asking, [&] { return map_ahead(size, stream); })) d_.departing.wait();
  }
}

bool DeviceCore::ask_neighbours(Asking& asking, const StillNeeded& still_needed) {
  if (!asking.hooks) return false;
  struct Done {  // set_share(nullptr) waits for this count to reach zero before the hooks go
    std::atomic<int>& in_flight;
    ~Done() { in_flight.fetch_sub(1, std::memory_order_release); }
  } done{asks_in_flight_};
  ShareHooks* hooks = std::exchange(asking.hooks, nullptr);
  hooks->ask(std::exchange(asking.need, {}), still_needed);
  asking.asked = true;
  return true;
}

// Under the whole device: the hooks to ask, once a request (nullptr where nobody shares the GPU
// or they were asked already), counted in flight until asked, with what the request needs.
ShareHooks* DeviceCore::hooks_to_ask(Asking& asking, AskFor need) {
  if (!share_ || asking.asked) return nullptr;
  const int process = static_cast<int>(::getpid());
  if (asks_process_ != process) {  // a forked child: its parent's asks are not its own
    asks_process_ = process;
    asks_in_flight_.store(0, std::memory_order_release);
  }
  asks_in_flight_.fetch_add(1, std::memory_order_acq_rel);
  asking.hooks = share_;
  asking.need = need;
  return asking.hooks;
}

bool DeviceCore::asks_in_flight() const {
  return asks_process_ == static_cast<int>(::getpid()) && asks_in_flight_.load(std::memory_order_acquire) > 0;
}

std::size_t DeviceCore::map_ahead(std::size_t size, StreamId stream) {
  const WholeDevice whole(*this);
  if (d_.capturing()) return size;  // the retry after the wait decides
  Request r{&pool_for(stream), is_small(size), stream, size};
  if (!sources_.growable.serves(*r.pool)) return device_lacks(device_bytes_for(r));
  d_.arena_for(stream).keep_one();
  const std::size_t lacking = sources_.growable.map_ahead(r, d_.backend.mem_info(d_.device).free);
  debug_check();
  return lacking;
}

// What the device must hold for `r`'s growth: the whole chunks a growable segment maps for it.
std::size_t DeviceCore::device_bytes_for(const Request& r) {
  return sources_.growable.serves(*r.pool) ? sources_.growable.most_mapped_for(r)
                                           : sources_.serving(*r.pool).growth_for(r.size);
}

std::size_t DeviceCore::device_lacks(std::size_t bytes) const {
  const std::size_t free = d_.backend.mem_info(d_.device).free;
  return bytes > free ? bytes - free : 0;
}

[[gnu::noinline]] Block* DeviceCore::malloc_on_device(std::size_t size, std::size_t requested, StreamId stream,
                                                      Asking& asking) {
  const WholeDevice whole(*this);
  ++on_device_;
  d_.lanes.add_stream(stream);  // before the stream's first block: its blocks' home is its lane's arena
  // While a graph may be capturing, event queries are illegal; blocks wait until it ends, or
  // until the capture graph shows they may be reused (core/capture_reuse.cpp).
  if (!d_.capturing()) {
    process_events();
  } else {
    while (Block* block = events_.take_followed(stream)) free_pending(block);
  }
  Request r{&pool_for(stream), is_small(size), stream, size};
  if (r.pool->paused()) {
    throw std::runtime_error("gpumem: allocating in a paused region: resume it first (gpumem.resume), or allocate outside it");
  }

  d_.arena_for(stream).keep_one();  // as in the lanes: before a cached block leaves the free set
  Block* block = try_cached(*r.pool, r);
  if (block) return place(block, size, requested, nullptr);
  measure_outside();
  if (!fits_under(allocated(), size, d_.accounts.cap().budget())) {
    // Only the others' floors and tensors stand in the way: they are asked for fresh figures.
    if (fits_under(allocated(), size, d_.accounts.cap().hard_budget()) && hooks_to_ask(asking, {allocated() + size, 0})) {
      return nullptr;
    }
    throw_oom(requested, size);
  }
  block = sources_.serving(*r.pool).grow(r);
  if (!block && r.pool == &d_.default_pool) block = d_.pools.take_for_oom(r.small, r.stream, r.size);
  bool retried = false;
  if (!block && release_.for_request(r)) {
    retried = true;
    block = sources_.serving(*r.pool).grow(r);
  }
  if (!block && !d_.capturing()) {
    retried = true;
    synchronize_and_process_events();
    release_.all_unused();
    block = try_cached(*r.pool, r);
    if (!block) block = sources_.serving(*r.pool).grow(r);
  }
  if (retried) d_.accounts.retried();
  if (!block && d_.departing.bytes() > 0) return nullptr;  // malloc waits for it and calls again
  if (!block && r.device_refused && hooks_to_ask(asking, {0, device_bytes_for(r)})) return nullptr;  // malloc asks, calls again
  if (!block) throw_oom(requested, size, r.device_refused);
  block = place(block, size, requested, nullptr);
  if (release_.threshold() > 0.0) release_.apply_threshold();
  return block;
}

LaneGates DeviceCore::lane_gates() const {
  const bool capturing = d_.capturing();
  return {!capturing && !events_.waiting() && !d_.accounts.ledger().any_pending(),
          !capturing && release_.threshold() == 0.0 && d_.accounts.cap().reserved() <= d_.accounts.cap().budget()};
}

FreeBins* DeviceCore::find_lane_bins(LaneSlot& slot, bool small) {
  FreeBins* bins = d_.default_pool.blocks_for(small).existing_bins(slot.stream);
  slot.bins[small ? 0 : 1] = bins;
  return bins;
}

std::size_t DeviceCore::allocated() const {
  // Uncached memory among them; paused regions' blocks not: they hold no memory (core/pause.cpp).
  return static_cast<std::size_t>(d_.accounts.ledger().allocated_bytes()) - paused_allocated_;
}

// Hands out the front of `block`, returning the rest to the pool where the block is worth cutting
// (cuts()), and counts the hand-out: the one rule for it, on either path.
// Inline in malloc: it runs on every allocation.
[[gnu::always_inline]] inline Block* DeviceCore::place(Block* block, std::size_t size, std::size_t requested,
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
  block->mark_allocated(requested);
  StatLedger& stats = lane ? lane->stats : d_.accounts.ledger();
  count_split(stats, segment, split.blocks, split.bytes);
  stats.hand_out(small, block->size, requested);
  if (!lane) debug_check();
  return block;
}

void DeviceCore::throw_oom(std::size_t requested, std::size_t size, bool device_refused, std::size_t resuming) {
  OomInfo info;
  info.device = d_.device;
  info.resuming = resuming;
  info.requested = requested;
  info.allocated = allocated();
  info.reserved = d_.accounts.cap().reserved();
  info.limit = d_.accounts.cap().limit();
  info.process_scope = scope_.scope() == LimitScope::kProcess;
  info.outside = d_.accounts.cap().outside();
  const MemInfo mem = d_.backend.mem_info(d_.device);
  info.device_free = mem.free;
  info.device_total = mem.total;
  info.largest_free_block = largest_free_block();
  if (share_) info.sharing = share_->describe(d_.backend.processes_on(d_.device));
  if (device_refused) {
    info.kind = OomKind::kDeviceFull;
  } else if (!fits_under(info.allocated, size, d_.accounts.cap().budget())) {
    info.kind = OomKind::kOverLimit;
    info.neighbours = fits_under(info.allocated, size, d_.accounts.cap().hard_budget());
  } else {
    info.kind = OomKind::kFragmentation;
  }
  d_.accounts.oom(info.kind);
  throw OutOfMemoryError(info);
}

void DeviceCore::measure_outside() {
  if (scope_.measure(d_)) release_.over_limit();  // what is outside may have grown past what reserved leaves it
}

// ---- free ----

// The cached free of a stream with a lane: a block no other stream used, of the default pool,
// while the lane is open (no capture, the limit not passed, no release threshold: nothing asks for
// more than the free set).
[[gnu::always_inline]] inline bool DeviceCore::free_in_lane(LaneSlot& slot, Block* block) {
  LaneGuard guard(*slot.lane);
  Lane& lane = guard.lane();
  if (!lane.free_open || !block->allocated || !block->stream_uses.empty()) return false;
  const Segment& segment = *block->segment;
  if (segment.pool != &d_.default_pool) return false;
  FreeBins* bins = lane_bins(slot, segment.small);
  if (!bins) return false;
  block->mark_freed();
  const InLane in_lane{bins, lane, d_.lane_ledgers.enter(d_.lanes, lane, d_.accounts.ledger())};
  free_block(block, &in_lane, true);
  debug_check_lane(lane);
  return true;
}

void DeviceCore::free(Block* block) {
  if (LaneSlot* slot = d_.lanes.slot_of(block->stream); slot && free_in_lane(*slot, block)) return;
  free_on_device(block);
}

[[gnu::noinline]] void DeviceCore::free_on_device(Block* block) {
  const WholeDevice whole(*this);
  ++on_device_;
  if (!block->allocated) throw std::logic_error("gpumem: block freed twice or never allocated");
  block->mark_freed();
  if (block->segment->pool->paused()) paused_allocated_ -= block->size;  // a tensor freed while paused
  if (block->stream_uses.empty()) {
    release_.after_free(free_block(block, nullptr, true));
    debug_check();
    return;
  }
  const bool small = block->segment->small;
  d_.accounts.ledger().release(small, block->size);
  d_.accounts.ledger().pend(small, block->size);
  if (!d_.capturing()) {
    events_.wait_for(block);
  } else {
    events_.defer(block);
  }
  debug_check();
}

void DeviceCore::free_pending(Block* block) {
  block->pend(0);
  d_.accounts.ledger().retire(block->segment->small, block->size);
  release_.after_free(free_block(block, nullptr, false));
}

// Back into the free set, merged with its free neighbours, and counted: the one rule for a free,
// on either path.
[[gnu::always_inline]] inline Block* DeviceCore::free_block(Block* block, const InLane* lane, bool released) {
  const Segment& segment = *block->segment;  // `block` itself may be folded into its neighbour
  const bool small = segment.small;
  const std::size_t size = block->size;
  const std::size_t requested = block->requested;
  block->clear_requested();
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
  StatLedger& stats = lane ? lane->stats : d_.accounts.ledger();
  if (released) stats.release(small, size);
  stats.settle(small, requested);
  count_split(stats, segment, split_blocks, split_bytes);
  return merge.block;
}

// ---- stream events ----

void DeviceCore::process_events() {
  if (!events_.waiting()) return;
  for (Block* block : events_.take_done()) free_pending(block);
}

// Counted whether or not anything is pending: Note [what num_sync_all_streams counts] (core/release.h).
void DeviceCore::synchronize_and_process_events() {
  d_.accounts.synced_all_streams();
  if (!events_.waiting()) return;
  d_.backend.synchronize(d_.device);
  process_events();
}

// ---- caching off (core/uncached.h) ----

void* DeviceCore::malloc_uncached(std::size_t requested, Asking& asking) {
  if (requested > SIZE_MAX - kMinBlockSize) throw_oom(requested, requested);
  const std::size_t bytes = round_size(requested);
  measure_outside();
  // New memory, as a growth of the chain is: the others are asked where their floors stand in the
  // way, or the device refuses.
  if (!fits_under(allocated(), bytes, d_.accounts.cap().budget())) {
    if (fits_under(allocated(), bytes, d_.accounts.cap().hard_budget()) && hooks_to_ask(asking, {allocated() + bytes, 0})) {
      return nullptr;
    }
    throw_oom(requested, bytes);
  }
  bool device_refused = false;
  void* ptr = uncached_.reserve(d_.accounts, bytes, requested, device_refused);
  if (!ptr && !d_.capturing()) {
    synchronize_and_process_events();
    release_.all_unused();
    ptr = uncached_.reserve(d_.accounts, bytes, requested, device_refused);
  }
  if (!ptr && d_.departing.bytes() > 0) return nullptr;  // the facade waits for it and calls again
  if (!ptr && device_refused && hooks_to_ask(asking, {0, bytes})) return nullptr;  // the facade asks, calls again
  if (!ptr) throw_oom(requested, bytes, device_refused);
  debug_check();
  return ptr;
}

bool DeviceCore::free_uncached(void* ptr) {
  const bool freed = uncached_.release(d_.accounts, ptr);
  if (freed) debug_check();
  return freed;
}

// ---- giving back, and private pools ----

void DeviceCore::empty_cache(PoolId id, std::vector<Departure>* departing) {
  const Deferring deferring(sources_.plain, departing);
  if (!id.is_default()) {
    empty_pool_cache(id);
  } else if (!d_.capturing()) {
    synchronize_and_process_events();
    release_.all_unused();
  } else {
    // A graph may be capturing: the default pool keeps its memory (freeing it would break the
    // capture), as native does; pools nobody holds are not being captured into.
    if (release_.unheld_pools_cache()) d_.accounts.released_cache();
  }
  d_.pools.erase_dead();
  debug_check();
}

std::size_t DeviceCore::release_for_others(std::size_t need, std::vector<Departure>* departing) {
  if (d_.capturing()) return 0;
  const Deferring deferring(sources_.plain, departing);
  if (events_.waiting()) {  // what the program freed on other streams goes back too
    d_.backend.synchronize(d_.device);
    process_events();
  }
  const std::size_t released = release_.for_others(need);
  sources_.growable.drop_empty();
  debug_check();
  return released;
}

// The second half of an empty_cache that deferred segments: each goes to its source with no lock
// held, then the cap lets go of their bytes under the whole device. A source that throws still has
// its bytes taken off the cap (what it holds is unknown, and waiters must not wait for ever); the
// first error is raised once every other segment went back.
void DeviceCore::give_back(const std::vector<Departure>& departing) {
  std::exception_ptr first;
  std::size_t bytes = 0;
  for (const Departure& segment : departing) {
    try {
      segment.source->release(segment.ptr, segment.bytes);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
    bytes += segment.bytes;
  }
  {
    const WholeDevice whole(*this);
    d_.accounts.departed(bytes);
    d_.departing.done(bytes);
    debug_check();
  }
  if (first) std::rethrow_exception(first);
}

// empty_cache of one pool: only if nobody holds it. Blocks still waiting for other streams are
// waited for first (outside a capture), so that what the program freed goes back; the wait is
// counted even when nothing waits, as native counts it (Note [what num_sync_all_streams counts]).
void DeviceCore::empty_pool_cache(PoolId id) {
  const Pool* pool = d_.pools.unheld(id);
  if (!pool) return;
  if (!d_.capturing()) synchronize_and_process_events();
  if (release_.pool_cache(*pool)) d_.accounts.released_cache();
}

void DeviceCore::end_target(PoolId id) {
  d_.pools.end_target(id);
  d_.pools.erase_dead();
  if (d_.capturing()) return;
  events_.end_capture();
  release_.over_limit();
}

void DeviceCore::release_pool(PoolId id) {
  if (!d_.pools.drop_holder(id)) return;
  release_.over_limit();
  d_.pools.erase_dead();
  debug_check();
}

std::size_t DeviceCore::largest_free_block() const {
  std::size_t largest = gpumem::largest_free_block(d_.default_pool);
  d_.pools.for_each([&](const Pool& pool) { largest = std::max(largest, gpumem::largest_free_block(pool)); });
  return largest;
}

}  // namespace gpumem
