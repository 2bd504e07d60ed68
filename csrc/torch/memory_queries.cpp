// What torch asks about a device's memory: statistics, the fraction of it set as the limit, free
// memory, the cache. A device whose allocator does not exist yet has allocated nothing: its
// statistics are zero and asking for them creates nothing.
#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "torch/allocator.h"
#include "torch/error_bridge.h"
#include "torch/stats_mapping.h"

namespace gpumem {

torch_compat::TorchDeviceStats TorchAllocator::getDeviceStats(DeviceIndex device) {
  const gpumem::DeviceAllocator* d = with_c10_errors([&] { return core_.existing(device); });
  return d ? to_torch_stats(d->stats()) : torch_compat::TorchDeviceStats{};
}

void TorchAllocator::resetAccumulatedStats(DeviceIndex device) {
  if (gpumem::DeviceAllocator* d = with_c10_errors([&] { return core_.existing(device); })) d->reset_accumulated_stats();
}

void TorchAllocator::resetPeakStats(DeviceIndex device) {
  if (gpumem::DeviceAllocator* d = with_c10_errors([&] { return core_.existing(device); })) d->reset_peak_stats();
}

// The device's allocator first: it checks the index, and its making runs the start-up, which sets
// the fraction read back until a call sets another.
double TorchAllocator::getMemoryFraction(DeviceIndex device) {
  this->device(device);
  return fractions_[device].load();
}

// torch.cuda.set_per_process_memory_fraction: gpumem's limit becomes fraction * total. As with
// any lower limit, cached segments above it are released; live tensors are never touched.
void TorchAllocator::setMemoryFraction(double fraction, DeviceIndex device) {
  TORCH_CHECK_VALUE(fraction >= 0.0 && fraction <= 1.0, "gpumem: bad memory fraction ", fraction, " for device ",
                    static_cast<int>(device),
                    ": expected a share of the device's total memory in [0, 1]; it sets gpumem's limit, which also "
                    "takes a size such as gpumem.set_limit(\"4GB\")");
  gpumem::DeviceAllocator& d = this->device(device);
  const auto limit = static_cast<std::size_t>(fraction * static_cast<double>(d.device_total()));
  with_c10_errors([&] { d.set_limit(std::optional<std::size_t>(limit)); });
  fractions_[device].store(fraction);
}

void TorchAllocator::set_startup_fraction(double fraction) {
  for (std::atomic<double>& f : fractions_) f.store(fraction);
}

// As native's emptyCache(pool), on every device: the default id releases the default pool's cached
// free segments and those of every private pool nobody holds; a private pool's id (MemPool's
// destructor passes its own) releases that pool's only, and only if nobody holds it. A held pool's
// cache stays: its CUDA graphs may replay into it. See DeviceAllocator::empty_cache.
#if GPUMEM_TORCH_HAS_EMPTY_CACHE_POOL
void TorchAllocator::emptyCache(MempoolId mempool_id) {
  const PoolId pool = torch_compat::to_gpumem(mempool_id);
#else
void TorchAllocator::emptyCache() {
  const PoolId pool{};
#endif
  const auto request = request_scope(0, History::RecordContext::ALL);
  for (int d = 0; d < core_.device_count(); ++d) {
    if (gpumem::DeviceAllocator* device = core_.existing(d)) with_c10_errors([&] { device->empty_cache(pool); });
  }
}

// As native: with *largest_block == 0 the caller wants a first guess of what a new segment could
// get, here the device's free memory capped by what the limit still allows; the answer is at least
// the largest cached free block.
void TorchAllocator::cacheInfo(DeviceIndex device, size_t* largest_block) {
  gpumem::DeviceAllocator& d = this->device(device);
  std::size_t largest = *largest_block;
  if (largest == 0) {
    const MemInfo mem = with_c10_errors([&] { return d.device_mem_info(); });
    const std::size_t budget = d.cap().budget(), reserved = d.reserved();
    largest = std::min(mem.free, budget > reserved ? budget - reserved : 0);
  }
  *largest_block = std::max(largest, d.largest_free_block());
}

void* TorchAllocator::getBaseAllocation(void* ptr, size_t* size) {
  for (int d = 0; d < core_.device_count(); ++d) {
    const gpumem::DeviceAllocator* device = core_.existing(d);
    if (!device) continue;
    if (const auto segment = device->segment_of(ptr)) {
      if (size) *size = segment->second;
      return reinterpret_cast<void*>(segment->first);
    }
  }
  TORCH_CHECK(false, "gpumem: getBaseAllocation of ", ptr, ", which is not in memory gpumem handed out");
}

// The device as a job under the cap sees it: its total is the limit, and free is what gpumem could
// still take from the device without passing the limit (limit - reserved, less the process's
// memory outside gpumem under a limit on the whole process, and no more than the device has free).
// Cached memory is not free, as native counts it. Uncapped, this is the device's own (free,
// total). `mem` is the device's own, as the caller measured it.
std::pair<size_t, size_t> TorchAllocator::capped_view(DeviceIndex device, MemInfo mem) {
  gpumem::DeviceAllocator& d = this->device(device);
  const std::size_t limit = std::min(d.limit(), mem.total), reserved = d.reserved();
  const std::size_t budget = std::min(d.cap().budget(), limit);
  return {std::min(mem.free, budget > reserved ? budget - reserved : 0), limit};
}

#if GPUMEM_TORCH_HAS_GET_MEMORY_INFO
// torch.accelerator.get_memory_info: the capped view, as torch.cuda.mem_get_info under gpumem.
std::pair<size_t, size_t> TorchAllocator::getMemoryInfo(DeviceIndex device) {
  return capped_view(device, with_c10_errors([&] { return this->device(device).device_mem_info(); }));
}
#endif

#if GPUMEM_TORCH_HAS_EXPANDABLE_SEGMENT_SIZES
// Native lists its expandable segments, except those of the default stream, each with its stream,
// pool kind and mapped bytes. gpumem keeps a growable segment per stream and size class of the default
// pool, as native does, and answers the same way: the mapped stretches its snapshot lists, summed
// per stream and size class (a second address range of a stream and class counts with the first).
std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> TorchAllocator::getExpandableSegmentSizes(
    DeviceIndex device) {
  const gpumem::DeviceAllocator* d = with_c10_errors([&] { return core_.existing(device); });
  if (!d) return {};
  std::map<std::pair<StreamId, bool>, std::size_t> mapped;  // (stream, small) -> bytes
  for (const SegmentInfo& segment : d->snapshot()) {
    if (segment.growable && segment.stream != 0) mapped[{segment.stream, segment.small}] += segment.size;
  }
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> sizes;
  for (const auto& [key, bytes] : mapped) {
    sizes.emplace_back(reinterpret_cast<cudaStream_t>(key.first), key.second, bytes);
  }
  return sizes;
}
#endif

}  // namespace gpumem
