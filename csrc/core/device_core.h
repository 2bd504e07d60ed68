// One device's caching allocator without its API: the fallback chain of malloc, the free path,
// the cached paths of the lanes, and the parts they are made of. The facade (core/device_allocator.h)
// takes the locks and calls in; every function here runs under the whole device (WholeDevice)
// unless it says it runs under a lane.
//
// malloc is a chain of fallbacks, each tried only when the one before could not serve:
//   1. a cached free block of the pool (best fit on the request's stream)
//   2. a new segment within the cap (the normal size, else the smallest that holds the request)
//   3. release cached free segments chosen by the release policy until the segment fits, retry
//   4. synchronize the device, release every cached free segment, retry
//   5. OutOfMemoryError saying which case it is: over the limit, device full, or fragmentation
// A default-pool request that step 2 could not serve first tries the cached free blocks of held
// use_on_oom pools (core/private_pools.h), before anything is released.
//
// The parts, each owning its state: what they share (DeviceState: cap, statistics, segments,
// pools, lanes), the sources of new memory (Sources), the blocks waiting for other streams
// (StreamEvents), memory handed out while caching is off (UncachedMemory), the releases
// (CacheRelease) and the limit's scope (ProcessScope). The checker (core/invariants.cpp) reads them.
#pragma once

#include <atomic>
#include <cstddef>
#include <map>
#include <optional>
#include <stdexcept>
#include <vector>

#include "core/backend.h"
#include "core/device_state.h"
#include "core/device_views.h"
#include "core/errors.h"
#include "core/process_scope.h"
#include "core/release.h"
#include "core/share_hooks.h"
#include "core/sources.h"
#include "core/split_merge.h"
#include "core/stream_events.h"
#include "core/uncached.h"

namespace gpumem {

struct AllocatorConfig {
  std::optional<std::size_t> limit;  // bytes; nullopt means the device's total
  // In (0, 1]: once reserved passes this share of the limit, the oldest cached free segments are
  // released until it is back under. 0 turns it off.
  double release_threshold = 0.0;
  // New memory comes from growable segments where the backend can map pages (the default), else
  // from plain segments. See core/growable_segments.cpp.
  bool growable = true;
  // The least chunk the large pool's growable segments map (Note [physical chunks] in
  // core/growable_segments.cpp): the least power-of-two number of pages at least this. 0, or a
  // page, maps requests under 256 pages page by page.
  std::size_t large_chunk = 0;
  LimitScope scope = LimitScope::kAllocator;
};

// Throws LimitSpecError if `limit` is above `total`, the device's memory: the one check of a limit
// against the device, at construction and at set_limit.
void check_limit_fits(std::optional<std::size_t> limit, int device, std::size_t total);

class DeviceCore;
// Throws std::logic_error describing the first broken invariant (see block.h): of the whole device,
// or, under one lane, of what the lane owns.
void check_device(const DeviceCore& core);
void check_lane(const DeviceCore& core, const Lane& lane);

class DeviceCore {
 public:
  DeviceCore(Backend& backend, int device, const AllocatorConfig& config, DeviceAllocator* owner);
  // Gives everything back, live blocks included, without throwing.
  ~DeviceCore();
  DeviceCore(const DeviceCore&) = delete;
  DeviceCore& operator=(const DeviceCore&) = delete;

  // The whole device for one call (core/lanes.h); letting it go opens or closes the lanes for what
  // the call left: lane_gates().
  // Taking it, the device's ledger takes in the lanes' (core/lane_ledgers.h): that changes how the
  // figures are kept, not what they are, so a const call may take it too.
  class WholeDevice {
   public:
    explicit WholeDevice(const DeviceCore& core) : core_(const_cast<DeviceCore&>(core)) {
      core_.d_.lanes.lock();
      core_.d_.lane_ledgers.take_in(core_.d_.lanes, core_.d_.accounts.ledger());
    }
    ~WholeDevice() { core_.d_.lanes.unlock(core_.lane_gates()); }
    WholeDevice(const WholeDevice&) = delete;
    WholeDevice& operator=(const WholeDevice&) = delete;

   private:
    DeviceCore& core_;
  };

  // A request's way to the other processes sharing the GPU (core/share_hooks.h): the chain under
  // the whole device hands out the hooks to ask, once a request; the caller asks them with no lock
  // held (ask_neighbours) and calls the chain again.
  struct Asking {
    ShareHooks* hooks = nullptr;  // to be asked; counted in asks_in_flight_ until then
    AskFor need;
    bool asked = false;
  };

  // Take their own locks: the stream's lane where it can serve, else the whole device.
  Block* malloc(std::size_t requested, StreamId stream, std::size_t at_least);
  void free(Block* block);

  // nullptr where memory on its way back may make room (wait for it: d_.departing) or the others
  // sharing the GPU are to be asked (ask_neighbours): then call again with the same `asking`.
  void* malloc_uncached(std::size_t size, Asking& asking);
  // Asks the hooks `asking` holds, with no allocator lock held; false if it holds none.
  // `still_needed` (ShareHooks::ask) is what the request still lacks on the device.
  bool ask_neighbours(Asking& asking, const StillNeeded& still_needed);
  // A request of `size` bytes (rounded) on `stream` the device refused, while the others give memory
  // back: maps what the device holds now of its growth (growable segments) and returns the bytes it
  // still lacks on the device, 0 once it can be served. Takes the whole device.
  std::size_t map_ahead(std::size_t size, StreamId stream);
  // The same for memory handed out while caching is off: `bytes` lacks what the device lacks.
  std::size_t device_lacks(std::size_t bytes) const;
  bool free_uncached(void* ptr);
  // With `departing`, the backend's plain segments it releases go there instead of to the backend
  // (core/departures.h); give_back, called with no lock held, then gives them back.
  void empty_cache(PoolId pool, std::vector<Departure>* departing = nullptr);
  void give_back(const std::vector<Departure>& departing);
  // DeviceAllocator::release_for_others's step: `need` bytes of the default pool's cache, largest
  // first, plain segments deferred to `departing` as empty_cache's are.
  std::size_t release_for_others(std::size_t need, std::vector<Departure>* departing);
  void set_limit(std::size_t limit);
  void set_scope(LimitScope scope);
  void end_target(PoolId pool);
  void release_pool(PoolId pool);
  std::size_t largest_free_block() const;

  // ---- regions, paused and resumed (core/pause.cpp) ----
  // Makes `id` a region's pool (growable segments wherever the backend maps pages), held for good;
  // throws std::invalid_argument where pages cannot be mapped or `id` is a pool already.
  void create_region(PoolId id);
  // Gives back the region's free cache, then unmaps the chunks of its live blocks, after copying
  // them to host memory with `backup`; returns the bytes paused (0 if it was paused already).
  // Waits for the device's queued work first. Throws std::logic_error while a pool target is
  // active (nothing may be unmapped then), changing nothing.
  std::size_t pause(PoolId id, bool backup);
  // Maps the paused chunks again at the same addresses, under the cap, and restores the backup;
  // returns the bytes resumed (0 if it was not paused). Where the cap or the device refuses, the
  // unused cache goes back and it tries again; then throws OutOfMemoryError naming the paused
  // bytes, the region still paused. std::logic_error while a pool target is active. Where the
  // device refused and others share the GPU, returns nullopt first, with the hooks in `asking`:
  // ask them (ask_neighbours) and call again.
  std::optional<std::size_t> resume(PoolId id, Asking& asking);
  // Frees the host copy a resumed region kept for its next pause; returns its bytes (0 if it has
  // none, or is paused: its backup is what resume copies back).
  std::size_t drop_backup(PoolId id);
  // Preparing a region's backup ahead of its pause, in three steps so that the slow middle one
  // (pinning host memory) runs with no lock held: the region's mapped runs of chunks that no host
  // memory it holds covers (none while paused), its held memory that covers none of them freed;
  // their host memory allocated; and that memory kept for the region, each range where no held
  // range overlaps it (a pause meanwhile may have made its own), the rest freed. keep_backup
  // returns the bytes kept (none where the region was paused meanwhile).
  std::vector<HostCopy> backup_wanted(PoolId id);
  void allocate_backup(std::vector<HostCopy>& copies) { d_.backend.allocate_backup(d_.device, copies); }  // with no lock held
  std::size_t keep_backup(PoolId id, std::vector<HostCopy>& copies);
  // The bytes paused regions gave back (their chunks), and their live blocks' bytes.
  std::size_t paused_bytes() const { return paused_bytes_; }
  std::size_t paused_allocated() const { return paused_allocated_; }
  // Waits until memory on its way back (d_.departing) is back; with no lock held.
  void wait_for_departures() { d_.departing.wait(); }
  // Whether asks handed out (Asking) still run with no lock held (a forked child has none, whatever
  // its parent had).
  bool asks_in_flight() const;

  // ---- the facade's calls (core/device_views.cpp), under the whole device unless they say
  // Facts of the device, set once: read without a lock.
  int device() const { return d_.device; }
  std::size_t device_total() const { return d_.device_total(); }
  MemInfo device_mem_info() const { return d_.backend.mem_info(d_.device); }
  std::size_t page_size() const { return sources_.growable.page_size(); }
  // Lock-free, as the cap reads out.
  const Cap& cap() const { return d_.accounts.cap(); }
  OutsideSource outside_source() const { return scope_.source(); }
  DeviceSettings settings() const;
  void set_share(ShareHooks* share);  // the hooks go once asks_in_flight() is false
  std::optional<MemInfo> mem_info_outside_capture() const;
  void set_shared_ceiling(std::size_t bytes);
  void watch_pressure(int slot, double share) { d_.accounts.watch_pressure(slot, share); }
  void set_release_threshold(double share) { release_.set_threshold(share); }
  void set_growable(bool on) { sources_.growable.set_on(on); }
  void set_large_chunk(std::size_t bytes) { sources_.growable.set_large_chunk(bytes); }
  void set_capture_reuse(bool on) { events_.set_capture_reuse(on); }
  DeviceStats stats() const { return d_.accounts.ledger().snapshot(); }
  void reset_peak_stats() { d_.accounts.reset_peaks(); }
  void reset_accumulated_stats() { d_.accounts.ledger().reset_accumulated(); }
  WorkCounts work_counts() const;
  std::vector<SegmentInfo> snapshot() const;
  std::optional<std::pair<std::uintptr_t, std::size_t>> segment_of(std::uintptr_t addr) const;
  std::optional<ShareRange> share_range(std::uintptr_t addr) const;
  // Takes its own lock: the block's lane where it has one, else the whole device.
  bool heads_a_split(const Block* block) const;
  void create_pool(PoolId id, std::shared_ptr<SegmentSource> source) { d_.pools.create(id, std::move(source)); }
  void begin_target(PoolId id, StreamFilter filter) { d_.pools.begin_target(id, std::move(filter)); }
  int pool_use_count(PoolId id) const { return d_.pools.use_count(id); }
  void set_pool_option(PoolId id, PoolOption option, bool on);
  // After every operation in builds with the checker compiled in (GPUMEM_CHECK_INVARIANTS).
  void debug_check() const {
#if GPUMEM_CHECK_INVARIANTS
    check_device(*this);
#endif
  }

 private:
  friend void check_device(const DeviceCore& core);
  friend void check_lane(const DeviceCore& core, const Lane& lane);

  // The cached path of a stream with a lane (core/lanes.h), under that lane only: nullptr, or
  // false, changing nothing, where the request needs the whole device (the lane is closed: a
  // capture, pending events, the limit passed, a release threshold; no cached block fits; another
  // pool; stream uses).
  inline Block* malloc_in_lane(LaneSlot& slot, std::size_t size, std::size_t requested);
  inline bool free_in_lane(LaneSlot& slot, Block* block);
  // The chain and the free under the whole device (what the lanes could not serve).
  Block* malloc_waiting(std::size_t size, std::size_t requested, StreamId stream);
  Block* malloc_on_device(std::size_t size, std::size_t requested, StreamId stream, Asking& asking);
  ShareHooks* hooks_to_ask(Asking& asking, AskFor need);
  std::size_t device_bytes_for(const Request& r);
  void free_on_device(Block* block);
  // What the lanes may serve while nothing holds the whole device: a cached malloc while no graph
  // captures and no block pends on a stream; a cached free while no graph captures, no release
  // threshold is set and reserved is within the budget (nothing asks a free for more than the free
  // set).
  LaneGates lane_gates() const;
  // The default pool's bins of the slot's stream, found once; nullptr if it has none yet.
  FreeBins* lane_bins(LaneSlot& slot, bool small) {
    FreeBins* bins = slot.bins[small ? 0 : 1];
    return bins ? bins : find_lane_bins(slot, small);
  }
  FreeBins* find_lane_bins(LaneSlot& slot, bool small);
  // place and free_block run on every cached malloc and free: inline, in device_core.cpp only.
  // `lane`: the caller's lane, the bins of the block's stream there, and the ledger its events go
  // to (the lane's own); nullptr under the whole device (the pool's set, the device's ledger).
  struct InLane {
    FreeBins* bins;
    Lane& lane;
    StatLedger& stats;
  };
  inline Block* place(Block* block, std::size_t size, std::size_t requested, const InLane* lane);
  // Back into the free set, merged with its free neighbours; returns the merged block. `released`:
  // the caller's free, which also leaves allocation (a pending block left it already).
  inline Block* free_block(Block* block, const InLane* lane, bool released);
  void free_pending(Block* block);  // a freed block no stream uses any more
  // `device_refused`: the device, not the cap, refused new memory for the request; `resuming`: the
  // paused bytes of a region that could not be resumed (core/pause.cpp), 0 for a request.
  [[noreturn]] void throw_oom(std::size_t requested, std::size_t size, bool device_refused = false,
                              std::size_t resuming = 0);
  // Allocated blocks and uncached memory: what the cap is measured against.
  std::size_t allocated() const;
  // The pool a request on `stream` goes to: the default pool unless a pool target takes the stream.
  Pool& pool_for(StreamId stream) { return d_.pools.target_for(stream, d_.default_pool); }
  void measure_outside();
  void process_events();
  void synchronize_and_process_events();
  void empty_pool_cache(PoolId id);
  // The same as debug_check after a lane's cached path, under that lane only: what the lane owns
  // (its streams' segments, their free bins, its arena's balance); the rest is checked under the
  // whole device.
  void debug_check_lane(const Lane& lane) const {
#if GPUMEM_CHECK_INVARIANTS
    check_lane(*this, lane);
#else
    (void)lane;
#endif
  }

  DeviceState d_;
  Sources sources_;
  StreamEvents events_;
  UncachedMemory uncached_;
  CacheRelease release_;
  ProcessScope scope_;
  // The mallocs and frees that took the whole device: every other one was served in a lane. Counted
  // here, on the slow path, so that the lanes' cached path counts nothing (for tests and benchmarks).
  std::uint64_t on_device_ = 0;
  ShareHooks* share_ = nullptr;  // the GPU's sharing (core/share_hooks.h), where this process shares it
  std::atomic<int> asks_in_flight_{0};  // asks running with no lock held (set_share waits for them)
  int asks_process_ = 0;                // the process they run in (under the whole device)
  // Paused regions (core/pause.cpp): their backups, the bytes they unmapped, and their live blocks'
  // bytes, which allocated() leaves out (they hold no memory while paused).
  // A region's backup: the host memory it holds (whole ranges, offset 0, disjoint, by address),
  // made by a pause or a prepare and kept after a resume for the next pause; and while it is
  // paused, the runs of chunks that pause copied, each inside one held range.
  struct Backup {
    std::vector<HostCopy> held;
    std::vector<HostCopy> copied;
  };
  std::map<PoolId, Backup> backups_;
  std::size_t paused_bytes_ = 0;
  std::size_t paused_allocated_ = 0;
  Pool& region_of(PoolId id) const;
  std::vector<HostCopy> mapped_runs(const Pool& pool) const;
  void cover(PoolId id, std::vector<HostCopy>& runs);
  std::size_t live_bytes_of(const Pool& pool) const;
};

}  // namespace gpumem
