// One device's caching allocator under a byte cap: its API and its locks, a table of contents.
//
// Each call takes the lock it needs and hands the work to the part that owns it:
//   - malloc and free: the stream's lane where the cached path can serve, else the whole device,
//     and the fallback chain (core/device_core.h, which lays the chain out);
//   - the limit, its scope and the release threshold: core/limits.cpp, core/process_scope.h,
//     core/release.h; the cap itself, core/cap.h;
//   - private pools (CUDA graphs, MemPools): core/private_pools.h;
//   - caching off: core/uncached.h; blocks other streams used: core/stream_events.h;
//   - statistics: core/stats.h; the sources of new memory: core/sources.h; the checker:
//     core/invariants.cpp.
// Locks (core/lanes.h): the cached malloc and free of a stream hold only that stream's lane, and
// write the one statistics ledger under its lock. Everything else holds the whole device
// (DeviceCore::WholeDevice: the device's lock and every lane), so it runs alone; every public
// method takes it at most once, and nothing below takes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "core/device_core.h"

namespace gpumem {

// The largest least chunk a process may set (AllocatorConfig::large_chunk): the largest chunk
// growable segments map (GrowableSegments::kMaxChunk). The Python settings take it from here.
inline constexpr std::size_t kMaxLargeChunk = GrowableSegments::kMaxChunk;

// std::invalid_argument, naming the bytes, for a least chunk above kMaxLargeChunk.
void check_large_chunk(std::size_t bytes);

class DeviceAllocator {
 public:
  DeviceAllocator(Backend& backend, int device, const AllocatorConfig& config)
      : core_(backend, device, config, this) {}

  int device() const { return core_.device(); }

  // ---- blocks ----
  // A block of at least `size` bytes usable on `stream`, and of at least `at_least` bytes (a
  // multiple of 512: a rounding the caller asks for); throws OutOfMemoryError.
  Block* malloc(std::size_t size, StreamId stream, std::size_t at_least = 0) {
    return core_.malloc(size, stream, at_least);
  }
  void free(Block* block) { core_.free(block); }
  // `block` is also used on `stream`: it is not reused until that stream's work queued so far is done.
  void record_stream(Block* block, StreamId stream);
  // Caching off: `size` bytes straight from the device, under the cap, outside the statistics;
  // throws OutOfMemoryError. free_uncached gives them back at once; false if `ptr` did not come
  // from malloc_uncached.
  void* malloc_uncached(std::size_t size);
  bool free_uncached(void* ptr);
  // Returns cached free segments to where they came from, as PyTorch's emptyCache(pool) does.
  // The default id: those of the default pool (unless a pool target is active: a graph may be
  // capturing) and of every private pool nobody holds. A private pool's id: that pool's, and only
  // if nobody holds it. A held pool's cache is never released.
  void empty_cache(PoolId pool = {});
  // For another process sharing the GPU (sharing/member.cpp): the default pool's largest cached
  // blocks until `bytes` went back (no more whole chunks than that needs), a step of at most
  // kReleaseStep at a time under the whole device, so that this process's own threads allocate in
  // between; nothing while a graph may be capturing. Returns the bytes released.
  std::size_t release_for_others(std::size_t bytes);
  static constexpr std::size_t kReleaseStep = std::size_t{4} << 30;

  // ---- the limit ----
  // The limit in bytes; nullopt lifts it (the device's total applies). Lowering releases cached
  // segments down to the new limit where it can; live blocks are never touched.
  void set_limit(std::optional<std::size_t> limit);
  // The same, from a limit spec ("4GB", "50%", "none", ...); a bad spec changes nothing.
  void set_limit(std::string_view spec);
  // Lock-free, as everything the cap reads out: the limit, reserved, outside, the budget and the
  // pressure watches' counts.
  std::size_t limit() const { return cap().limit(); }
  std::size_t reserved() const { return cap().reserved(); }
  const Cap& cap() const { return core_.cap(); }
  // What the limit bounds; setting kProcess (where it was not) measures the memory outside the
  // allocator at once if the device holds memory, and releases cached memory down to the budget
  // it leaves. Setting the scope in effect changes nothing.
  void set_scope(LimitScope scope);
  // Where the figure of the memory outside the allocator came from (lock-free).
  OutsideSource outside_source() const { return core_.outside_source(); }
  // Counts crossings of `share` of the limit in watch slot `slot` (core/pressure.h).
  void watch_pressure(int slot, double share);
  // Sharing the GPU (sharing/member.h): the hooks, and the ceiling the others' floors leave,
  // released down to as a lowered limit is. The hooks must outlive the allocator or be unset.
  void set_share(ShareHooks* share);
  void set_shared_ceiling(std::size_t bytes);
  void set_release_threshold(double share);

  // ---- how memory is made ----
  // Whether new memory of the default pool comes from growable segments. Asking for them where the
  // backend cannot map pages keeps plain segments; memory already reserved stays as it is.
  void set_growable(bool on);
  // The least chunk the large pool's new growable memory is mapped in (AllocatorConfig::
  // large_chunk); check_large_chunk's error, changing nothing, for a bad one.
  void set_large_chunk(std::size_t bytes);
  // The backend's page size for growable segments; 0 where it cannot map pages.
  std::size_t page_size() const { return core_.page_size(); }
  // Whether a block freed during a capture while other streams used it may be reused before the
  // capture ends, once the capture graph shows those streams' work joined the block's stream
  // (torch's graph_capture_record_stream_reuse). Off by default, as in torch.
  void set_capture_reuse(bool on);

  // What is set: the limit's scope, the release threshold, and whether growable segments are in
  // effect (asked for and supported).
  DeviceSettings settings() const;

  // ---- statistics and views ----
  DeviceStats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  WorkCounts work_counts() const;
  std::size_t largest_free_block() const;  // the largest cached free block, in bytes
  MemInfo device_mem_info() { return core_.device_mem_info(); }
  // The same, read under the whole device unless a graph may be capturing (nullopt then: the
  // driver does not allow the call during a capture).
  std::optional<MemInfo> mem_info_outside_capture();
  std::size_t device_total() const { return core_.device_total(); }
  std::vector<SegmentInfo> snapshot() const;
  // The segment start and size holding `ptr`, if any.
  std::optional<std::pair<std::uintptr_t, std::size_t>> segment_of(const void* ptr) const;
  // The allocated block holding `ptr` and the memory behind it, for sharing it with another
  // process; nullopt where no allocated block of this device holds `ptr`.
  std::optional<ShareRange> share_range(const void* ptr) const;
  // Whether `block` (allocated) starts its segment, or a mapped stretch of a growable one, and was
  // split off the front of a larger free block: cached free memory follows it.
  bool heads_a_split(const Block* block) const { return core_.heads_a_split(block); }

  // ---- private pools (core/private_pools.h) ----
  // While a pool is the allocation target for streams the filter accepts, requests on those
  // streams come from that pool and nothing waits on events.
  // Creates the pool with one holder, its segments from `source` (nullptr: the backend), or adds a
  // holder to an existing pool; giving a source for an existing pool throws std::invalid_argument.
  void create_pool(PoolId id, std::shared_ptr<SegmentSource> source = nullptr);
  void begin_allocate_to_pool(PoolId id, StreamFilter filter);
  void end_allocate_to_pool(PoolId id);
  // Drops a holder. An unheld pool's cache may go: at empty_cache, or when memory is needed.
  void release_pool(PoolId id);
  int pool_use_count(PoolId id) const;
  // An unknown pool, or turning kNoSplit off, throws std::invalid_argument.
  void set_pool_option(PoolId id, PoolOption option, bool on);

  // ---- regions, paused and resumed (core/pause.cpp; DeviceCore says what each does) ----
  // A region is a private pool: its requests come from it while begin_allocate_to_pool names it.
  void create_region(PoolId id);
  std::size_t pause(PoolId id, bool backup);
  std::size_t resume(PoolId id);
  std::size_t drop_backup(PoolId id);
  // Pins host memory for the region's next pause now (DeviceCore::backup_wanted); the bytes pinned.
  // The pinning runs with no lock held: the device's requests go on meanwhile.
  std::size_t prepare_backup(PoolId id);
  // The bytes paused regions gave back, and their live blocks' bytes.
  std::size_t paused_bytes() const;
  std::size_t paused_allocated() const;

  // Throws std::logic_error describing the first broken invariant (see block.h).
  void check_invariants() const;

 private:
  using WholeDevice = DeviceCore::WholeDevice;

  DeviceCore core_;
};

}  // namespace gpumem
