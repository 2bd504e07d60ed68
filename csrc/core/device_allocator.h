// One device's caching allocator under a byte cap.
//
// malloc is a chain of fallbacks, each tried only when the one before could not serve:
//   1. a cached free block of the pool (best fit on the request's stream)
//   2. a new segment within the cap (the normal size, else the smallest that holds the request)
//   3. release cached free segments chosen by the release policy until the segment fits, retry
//   4. synchronize the device, release every cached free segment, retry
//   5. OutOfMemoryError saying which case it is: over the limit, device full, or fragmentation
// A default-pool request that step 2 could not serve first tries the cached free blocks of held
// use_on_oom pools (core/private_pools.cpp), before anything is released.
//
// The class is written over several files, one concept each: the chain, free and stream events
// here and in device_allocator.cpp; the limit and its scope in limits.cpp; releasing cached memory
// in release.cpp; private pools in private_pools.cpp; caching off in uncached.cpp; capture reuse
// in capture_reuse.cpp; the checker in invariants.cpp. What it holds in common with the sources of
// new memory is a DeviceState (device_state.h); the sources are PlainSegments and GrowableSegments
// behind MemorySource (memory_source.h). The free set, split and merge, the cap and the statistics
// are types of their own (free_set.h, split_merge.h, cap.h, stats.h).
//
// Locks (core/lanes.h): the cached malloc and free of a stream hold only that stream's lane, and
// write the one statistics ledger under its lock (malloc_in_lane, free_in_lane). Everything else
// holds the whole device (WholeDevice: the device's lock and every lane), so it runs alone; every
// public method takes it once, and private methods (suffix _locked where it matters) never take
// it.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "core/block.h"
#include "core/device_state.h"
#include "core/growable_segments.h"
#include "core/lanes.h"
#include "core/plain_segments.h"
#include "core/split_merge.h"
#include "core/lock.h"
#include "core/errors.h"
#include "core/stats.h"

namespace gpumem {

// What a device's limit bounds. kAllocator: the bytes the allocator reserves (segments and
// uncached memory). kProcess: everything the driver counts for the process on the device, the
// allocator's reserved bytes plus what it does not hold (Note [a limit on the whole process]).
enum class LimitScope { kAllocator, kProcess };
const char* limit_scope_name(LimitScope scope);  // "allocator", "process"

// Where the memory outside the allocator, under LimitScope::kProcess, was last measured from.
enum class OutsideSource {
  kNone,               // not measured: the scope is kAllocator, or nothing grew since it was set
  kProcessAccounting,  // the driver's figure for this process (NVML), at the last growth
  kDeviceAtFirst,      // the device's used memory at the first measurement: no per-process figure
};
const char* outside_source_name(OutsideSource source);  // "none", "process accounting", "device at first use"

struct AllocatorConfig {
  std::optional<std::size_t> limit;  // bytes; nullopt means the device's total
  // In (0, 1]: once reserved passes this share of the limit, the oldest cached free segments are
  // released until it is back under. 0 turns it off.
  double release_threshold = 0.0;
  // New memory comes from growable segments where the backend can map pages (the default), else
  // from plain segments. See core/growable_segments.cpp.
  bool growable = true;
  LimitScope scope = LimitScope::kAllocator;
};

// Throws LimitSpecError unless `share` is a release threshold: in (0, 1], or 0 (off).
void check_release_threshold(double share);

// A read-only picture of the device's memory, for snapshots and reports.
struct BlockInfo {
  std::uintptr_t addr;
  std::size_t size;
  std::size_t requested;
  enum State { kFree, kAllocated, kPendingFree } state;
};
struct SegmentInfo {
  std::uintptr_t addr;
  std::size_t size;
  StreamId stream;
  PoolId pool;
  bool small;
  bool growable;  // a mapped stretch of a growable segment: one SegmentInfo per stretch
  std::vector<BlockInfo> blocks;
};

class DeviceAllocator {
 public:
  DeviceAllocator(Backend& backend, int device, const AllocatorConfig& config);
  ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  int device() const { return d_.device; }

  // A block of at least `size` bytes usable on `stream`, and of at least `at_least` bytes (a
  // multiple of 512: a rounding the caller asks for); throws OutOfMemoryError.
  Block* malloc(std::size_t size, StreamId stream, std::size_t at_least = 0);
  void free(Block* block);
  // `block` is also used on `stream`: it is not reused until that stream's work queued so far is done.
  void record_stream(Block* block, StreamId stream);

  // Caching off (core/uncached.cpp): `size` bytes straight from the device, under the cap, outside
  // the statistics; throws OutOfMemoryError. free_uncached gives them back at once; false if `ptr`
  // did not come from malloc_uncached.
  void* malloc_uncached(std::size_t size);
  bool free_uncached(void* ptr);
  std::size_t uncached_bytes() const;

  // Returns cached free segments to where they came from, as PyTorch's emptyCache(pool) does.
  // The default id: those of the default pool (unless a pool target is active: a graph may be
  // capturing) and of every private pool nobody holds. A private pool's id: that pool's, and only
  // if nobody holds it. A held pool's cache is never released.
  void empty_cache(PoolId pool = {});

  // The limit in bytes; nullopt lifts it (the device's total applies). Lowering releases cached
  // segments down to the new limit where it can; live blocks are never touched.
  void set_limit(std::optional<std::size_t> limit);
  // The same, from a limit spec ("4GB", "50%", "none", ...); a bad spec changes nothing.
  void set_limit(std::string_view spec);
  std::size_t limit() const { return d_.cap.limit(); }
  std::size_t reserved() const { return d_.cap.reserved(); }  // lock-free, as limit()
  // What the limit bounds; setting kProcess (where it was not) measures the memory outside the
  // allocator at once if the device holds memory, and releases cached memory down to the budget
  // it leaves. Setting the scope in effect changes nothing.
  void set_scope(LimitScope scope);
  LimitScope scope() const;
  // The process's memory on the device outside the allocator, as last measured (0 under
  // kAllocator), and where that figure came from. Lock-free, as limit().
  std::size_t outside() const { return d_.cap.outside(); }
  // What reserved may grow to: the limit, less outside under kProcess. Lock-free, as limit().
  std::size_t budget() const { return d_.cap.budget(); }
  OutsideSource outside_source() const { return outside_source_.load(std::memory_order_relaxed); }
  // Counts crossings of `share` of the limit in watch slot `slot` (core/pressure.h); the counts
  // are read without the lock.
  void watch_pressure(int slot, double share);
  const PressureWatches& pressure() const { return d_.cap.pressure(); }
  void set_release_threshold(double share);
  double release_threshold() const;

  // Whether new memory of the default pool comes from growable segments. Asking for them where the
  // backend cannot map pages keeps plain segments; memory already reserved stays as it is.
  void set_growable(bool on);
  // Whether a block freed during a capture while other streams used it may be reused before the
  // capture ends, once the capture graph shows those streams' work joined the block's stream
  // (torch's graph_capture_record_stream_reuse). Off by default, as in torch.
  void set_capture_reuse(bool on);
  bool growable() const;                       // in effect: asked for and supported
  bool growable_supported() const { return growable_.supported(); }
  std::size_t page_size() const { return growable_.page_size(); }
  std::uint64_t growable_blocks_visited() const { return growable_.blocks_visited(); }  // for tests

  DeviceStats stats() const;
  // How many mallocs and frees each stream's cached path served on its own (core/lanes.h), without
  // the whole device: for tests and benchmarks.
  std::uint64_t served_in_lanes() const;
  // Every Block the arenas made, spare or in segments: the host memory the block lists hold. Flat
  // while the blocks in use are (core/lanes.h: every Block keeps its home); for tests.
  std::size_t blocks_made() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  // The largest cached free block, in bytes.
  std::size_t largest_free_block() const;
  MemInfo device_mem_info();
  std::size_t device_total() const { return d_.device_total; }

  std::vector<SegmentInfo> snapshot() const;
  // The segment start and size holding `ptr`, if any.
  std::optional<std::pair<std::uintptr_t, std::size_t>> segment_of(const void* ptr) const;
  // Whether `block` (allocated) starts its segment, or a mapped stretch of a growable one, and was
  // split off the front of a larger free block: cached free memory follows it.
  bool heads_a_split(const Block* block) const;

  // Private pools (CUDA graphs, MemPools; core/private_pools.cpp). While a pool is the allocation
  // target for streams the filter accepts, requests on those streams come from that pool and
  // nothing waits on events.
  // Creates the pool with one holder, its segments from `source` (nullptr: the backend), or adds a
  // holder to an existing pool; giving a source for an existing pool throws std::invalid_argument.
  void create_pool(PoolId id, std::shared_ptr<SegmentSource> source = nullptr);
  void begin_allocate_to_pool(PoolId id, StreamFilter filter);
  void end_allocate_to_pool(PoolId id);
  // Drops a holder. An unheld pool's cache may go: at empty_cache, or when memory is needed.
  void release_pool(PoolId id);
  int pool_use_count(PoolId id) const;
  // Pool options (MemPool's no_split and use_on_oom); an unknown pool throws std::invalid_argument.
  void set_no_split(PoolId id);
  void set_use_on_oom(PoolId id, bool on);

  // Throws std::logic_error describing the first broken invariant (see block.h).
  void check_invariants() const;

 private:
  struct PendingFree {
    Block* block;
    EventId event;
  };

  std::size_t allocated_locked() const;  // allocated blocks and uncached memory: what the cap is measured against
  void* reserve_uncached(std::size_t bytes, bool& device_refused);
  // The pool a request on `stream` goes to: the default pool unless a pool target takes the stream.
  Pool& pool_for_locked(StreamId stream) { return d_.capturing() ? targeted_pool_locked(stream) : d_.default_pool; }
  Pool& targeted_pool_locked(StreamId stream);
  // A cached free block of `pool` for the request (its class, stream and size), or nullptr.
  static Block* try_cached(Pool& pool, const Request& r) { return pool.blocks_for(r.small).take_best_fit(r.stream, r.size); }
  void measure_outside_locked();
  // The source of a pool's new memory, and the one a segment came from.
  MemorySource& memory_for(const Pool& pool) { return growable_.serves(pool) ? static_cast<MemorySource&>(growable_) : plain_; }
  MemorySource& memory_of(const Segment& segment) { return segment.growable ? static_cast<MemorySource&>(growable_) : plain_; }
  Block* try_use_on_oom_pools(const Request& r);
  // The cached path of a stream with a lane (core/lanes.h), under that lane only: nullptr, or
  // false, changing nothing, where the request needs the whole device (the lane is closed: a
  // capture, pending events, the limit passed, a release threshold; no cached block fits; another
  // pool; stream uses).
  inline Block* malloc_in_lane(LaneSlot& slot, std::size_t size, std::size_t requested);
  inline bool free_in_lane(LaneSlot& slot, Block* block);
  // The chain and the free under the whole device (what the lanes could not serve).
  Block* malloc_on_device(std::size_t size, std::size_t requested, StreamId stream);
  void free_on_device(Block* block);
  // The whole device for one call (core/lanes.h); letting it go opens or closes the lanes for what
  // the call left: lane_gates().
  class WholeDevice {
   public:
    explicit WholeDevice(const DeviceAllocator& a) : a_(a) { a_.d_.lanes.lock(); }
    ~WholeDevice() { a_.d_.lanes.unlock(a_.lane_gates()); }
    WholeDevice(const WholeDevice&) = delete;
    WholeDevice& operator=(const WholeDevice&) = delete;

   private:
    const DeviceAllocator& a_;
  };
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
  // place and free_block run on every cached malloc and free: inline, in device_allocator.cpp only.
  // `lane`: the caller's lane and the bins of the block's stream there, whose statistics' events
  // are written under the ledger's lock; nullptr under the whole device (the pool's set).
  struct InLane {
    FreeBins* bins;
    Lane& lane;
  };
  // Whether handing out `size` bytes of free `block` cuts it: the rest is worth keeping and the pool
  // splits blocks (its no_split is read only when a split is due).
  static bool cuts(const Block& block, std::size_t size) {
    return should_split(block.size, size) && !block.segment->pool->no_split;
  }
  // What handing out `size` bytes of free `block` (cut or not) does to the inactive split blocks,
  // as native counts them: a split block that is cut gives the caller `size` bytes (it stays one
  // inactive split block); an unsplit one that is cut leaves a new one, its rest; a split block
  // handed out whole is one fewer.
  struct SplitChange {
    std::int64_t blocks = 0;
    std::int64_t bytes = 0;
  };
  static SplitChange split_change_of(const Block& block, std::size_t size, bool cut) {
    const bool was_split = block.is_split();
    if (cut) {
      return was_split ? SplitChange{0, -static_cast<std::int64_t>(size)}
                       : SplitChange{1, static_cast<std::int64_t>(block.size - size)};
    }
    return was_split ? SplitChange{-1, -static_cast<std::int64_t>(block.size)} : SplitChange{};
  }
  inline Block* place(Block* block, std::size_t size, std::size_t requested, const InLane* lane);
  // `device_refused`: the device, not the cap, refused new memory for the request.
  [[noreturn]] void throw_oom(std::size_t requested, std::size_t size, bool device_refused = false);

  // Back into the free set, merged with its free neighbours; returns the merged block. `released`:
  // the caller's free, which also leaves allocation (a pending block left it already).
  inline Block* free_block(Block* block, const InLane* lane, bool released);
  // After a free under the whole device: releases what the limit or the release threshold asks.
  void release_after_free(const Block* merged);
  // Inactive split blocks changed in `segment`; counted in plain segments only (StatLedger::split_change).
  void count_split(const Segment& segment, std::int64_t blocks, std::int64_t bytes) {
    if (!segment.growable) d_.stats.split_change(segment.small, blocks, bytes);
  }
  void free_pending(Block* block);  // a freed block no stream uses any more
  void defer(Block* block);
  void reuse_deferred(StreamId stream);
  void insert_events(Block* block);
  void process_events();
  void synchronize_and_process_events();

  bool release_oldest_until(std::size_t reserved_target);
  bool release_bytes(std::size_t need, ReleaseOrder order);
  void give_back_over_limit();
  bool release_all_unused();
  bool release_for(const Request& r);
  void set_limit_locked(std::size_t limit);
  void apply_release_threshold();
  bool is_target(const Pool* pool) const;
  Pool& existing_pool(PoolId id) const;
  bool release_pool_cache(const Pool& pool);
  bool release_unheld_pools_cache();
  void empty_pool_cache(PoolId id);
  void release_free_pools();
  std::size_t largest_free_block_locked() const;
  void check_invariants_locked() const;
  // After every operation in builds with the checker compiled in (GPUMEM_CHECK_INVARIANTS).
  void debug_check() const {
#if GPUMEM_CHECK_INVARIANTS
    check_invariants_locked();
#endif
  }
  // The same after a lane's cached path, under that lane only: what the lane owns (its streams'
  // segments, their free bins, its arena's balance); the rest is checked under the whole device.
  void debug_check_lane(const Lane& lane) const {
#if GPUMEM_CHECK_INVARIANTS
    check_lane_locked(lane);
#else
    (void)lane;
#endif
  }
  void check_lane_locked(const Lane& lane) const;
  void check_arenas_locked() const;

  DeviceState d_;
  PlainSegments plain_;
  GrowableSegments growable_;
  LimitScope scope_ = LimitScope::kAllocator;
  std::atomic<OutsideSource> outside_source_{OutsideSource::kNone};
  double release_threshold_;
  std::map<PoolId, std::unique_ptr<Pool>> private_pools_;
  std::deque<PendingFree> pending_;
  // Freed with stream uses while a pool target was active: held until the capture ends, or
  // until the request's stream follows every marker (none: only the end of the capture frees it).
  struct Deferred {
    Block* block;
    std::vector<CaptureMarker> markers;  // one per stream that used the block
  };
  std::vector<Deferred> deferred_;
  bool capture_reuse_ = false;
  std::unordered_map<std::uintptr_t, std::size_t> uncached_;  // address -> bytes, caching off
  std::size_t uncached_bytes_ = 0;
};

}  // namespace gpumem
