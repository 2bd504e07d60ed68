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
  block->use_on(stream);
}

void* DeviceAllocator::malloc_uncached(std::size_t size) {
  DeviceCore::Asking asking;
  for (;;) {
    {
      const WholeDevice whole(core_);
      if (void* ptr = core_.malloc_uncached(size, asking)) return ptr;
    }
    // Memory on its way back may make room (core/departures.h), or the others sharing the GPU.
    const std::size_t bytes = asking.need.device_bytes;
    if (!core_.ask_neighbours(asking, [this, bytes] { return core_.device_lacks(bytes); })) core_.wait_for_departures();
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

std::size_t DeviceAllocator::release_for_others(std::size_t bytes) {
  std::size_t released = 0;
  while (released < bytes) {
    std::vector<Departure> departing;
    std::size_t step = 0;
    std::exception_ptr error;
    {
      const WholeDevice whole(core_);
      try {
        step = core_.release_for_others(std::min(bytes - released, kReleaseStep), &departing);
      } catch (...) {
        error = std::current_exception();  // what was taken out of the tables still goes back
      }
    }
    if (!departing.empty()) core_.give_back(departing);
    if (error) std::rethrow_exception(error);
    if (step == 0) break;
    released += step;
  }
  return released;
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
  return core_.settings();
}

void DeviceAllocator::set_share(ShareHooks* share) {
  {
    const WholeDevice whole(core_);
    core_.set_share(share);
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
  return core_.mem_info_outside_capture();
}

void DeviceAllocator::set_shared_ceiling(std::size_t bytes) {
  const WholeDevice whole(core_);
  core_.set_shared_ceiling(bytes);
}

void DeviceAllocator::watch_pressure(int slot, double share) {
  const WholeDevice whole(core_);
  core_.watch_pressure(slot, share);
}

void DeviceAllocator::set_release_threshold(double share) {
  const WholeDevice whole(core_);  // CacheRelease::set_threshold checks the share before it changes anything
  core_.set_release_threshold(share);
}

// ---- how memory is made ----

void DeviceAllocator::set_growable(bool on) {
  const WholeDevice whole(core_);
  core_.set_growable(on);
}

void check_large_chunk(std::size_t bytes) {
  if (bytes > kMaxLargeChunk) {
    throw std::invalid_argument("gpumem: a chunk of " + std::to_string(bytes) + " bytes is larger than the largest, " +
                                std::to_string(kMaxLargeChunk) + " bytes; accepted: 0 (pages) to " +
                                std::to_string(kMaxLargeChunk >> 20) + " MiB");
  }
}

void DeviceAllocator::set_large_chunk(std::size_t bytes) {
  check_large_chunk(bytes);
  const WholeDevice whole(core_);
  core_.set_large_chunk(bytes);
}

void DeviceAllocator::set_capture_reuse(bool on) {
  const WholeDevice whole(core_);
  core_.set_capture_reuse(on);
}

// ---- statistics and views ----

DeviceStats DeviceAllocator::stats() const {
  const WholeDevice whole(core_);
  return core_.stats();
}

void DeviceAllocator::reset_peak_stats() {
  const WholeDevice whole(core_);
  core_.reset_peak_stats();
}

void DeviceAllocator::reset_accumulated_stats() {
  const WholeDevice whole(core_);
  core_.reset_accumulated_stats();
}

WorkCounts DeviceAllocator::work_counts() const {
  const WholeDevice whole(core_);
  return core_.work_counts();
}

std::size_t DeviceAllocator::largest_free_block() const {
  const WholeDevice whole(core_);
  return core_.largest_free_block();
}

std::vector<SegmentInfo> DeviceAllocator::snapshot() const {
  const WholeDevice whole(core_);
  return core_.snapshot();
}

std::optional<std::pair<std::uintptr_t, std::size_t>> DeviceAllocator::segment_of(const void* ptr) const {
  const WholeDevice whole(core_);
  return core_.segment_of(reinterpret_cast<std::uintptr_t>(ptr));
}

std::optional<ShareRange> DeviceAllocator::share_range(const void* ptr) const {
  const WholeDevice whole(core_);
  return core_.share_range(reinterpret_cast<std::uintptr_t>(ptr));
}

// ---- private pools ----

void DeviceAllocator::create_pool(PoolId id, std::shared_ptr<SegmentSource> source) {
  const WholeDevice whole(core_);
  core_.create_pool(id, std::move(source));
}

void DeviceAllocator::begin_allocate_to_pool(PoolId id, StreamFilter filter) {
  const WholeDevice whole(core_);
  core_.begin_target(id, std::move(filter));
}

void DeviceAllocator::end_allocate_to_pool(PoolId id) {
  const WholeDevice whole(core_);
  core_.end_target(id);
}

void DeviceAllocator::create_region(PoolId id) {
  const WholeDevice whole(core_);
  core_.create_region(id);
}

std::size_t DeviceAllocator::pause(PoolId id, bool backup) {
  const WholeDevice whole(core_);
  return core_.pause(id, backup);
}

// As malloc: the others sharing the GPU are asked with no lock held, once.
std::size_t DeviceAllocator::resume(PoolId id) {
  DeviceCore::Asking asking;
  for (;;) {
    std::optional<std::size_t> resumed;
    {
      const WholeDevice whole(core_);
      resumed = core_.resume(id, asking);
    }
    if (resumed) return *resumed;
    const std::size_t need = asking.need.device_bytes;
    core_.ask_neighbours(asking, [this, need] { return core_.device_lacks(need); });
  }
}

std::size_t DeviceAllocator::drop_backup(PoolId id) {
  const WholeDevice whole(core_);
  return core_.drop_backup(id);
}

std::size_t DeviceAllocator::prepare_backup(PoolId id) {
  std::vector<HostCopy> wanted;
  {
    const WholeDevice whole(core_);
    wanted = core_.backup_wanted(id);
  }
  if (wanted.empty()) return 0;
  core_.allocate_backup(wanted);  // throws having freed what it allocated
  const WholeDevice whole(core_);
  return core_.keep_backup(id, wanted);
}

std::size_t DeviceAllocator::paused_bytes() const {
  const WholeDevice whole(core_);
  return core_.paused_bytes();
}

std::size_t DeviceAllocator::paused_allocated() const {
  const WholeDevice whole(core_);
  return core_.paused_allocated();
}

void DeviceAllocator::release_pool(PoolId id) {
  const WholeDevice whole(core_);
  core_.release_pool(id);
}

int DeviceAllocator::pool_use_count(PoolId id) const {
  const WholeDevice whole(core_);
  return core_.pool_use_count(id);
}

void DeviceAllocator::set_pool_option(PoolId id, PoolOption option, bool on) {
  const WholeDevice whole(core_);
  core_.set_pool_option(id, option, on);
}

void DeviceAllocator::check_invariants() const {
  const WholeDevice whole(core_);
  check_device(core_);
}

}  // namespace gpumem
