// Private pools: CUDA graph capture, torch.cuda.MemPool, torch.compile's cudagraph trees.
//
// Holders, as native counts them: createOrIncrefPool (MemPool's constructor) and every
// beginAllocateToPool add one; releasePool drops one (a graph's reset, MemPool's destructor, the
// end of use_mem_pool after endAllocateToPool). A pool nobody holds is freeable: its cache goes at
// emptyCache (MemPool's destructor calls emptyCache(its id) after releasePool) or when memory is
// needed (see core/private_pools.cpp).
//
// A MemPool may bring its own allocator: its pool's segments then come from that allocator
// (pool_source.h), under gpumem's cap like any other.
#include <memory>
#include <type_traits>

#include "torch/allocator.h"
#include "torch/error_bridge.h"
#include "torch/pool_source.h"

namespace gpumem {

namespace {

template <class Pointer>
const void* address_of(const Pointer& pointer) {
  if constexpr (std::is_pointer_v<Pointer>) {
    return pointer;
  } else {
    return pointer.get();
  }
}

}  // namespace

void TorchAllocator::beginAllocateToPool(DeviceIndex device, MempoolId mempool_id,
                                         std::function<bool(cudaStream_t)> filter) {
  gpumem::DeviceAllocator& d = this->device(device);
  const PoolId pool = torch_compat::to_gpumem(mempool_id);
  with_c10_errors([&] {
    d.create_pool(pool);
    d.set_capture_reuse(torch_compat::capture_record_stream_reuse());
    d.begin_allocate_to_pool(pool, [filter = std::move(filter)](StreamId stream) {
      return filter(reinterpret_cast<cudaStream_t>(stream));
    });
  });
}

void TorchAllocator::endAllocateToPool(DeviceIndex device, MempoolId mempool_id) {
  gpumem::DeviceAllocator& d = this->device(device);
  with_c10_errors([&] { d.end_allocate_to_pool(torch_compat::to_gpumem(mempool_id)); });
}

void TorchAllocator::releasePool(DeviceIndex device, MempoolId mempool_id) {
  gpumem::DeviceAllocator& d = this->device(device);
  with_c10_errors([&] { d.release_pool(torch_compat::to_gpumem(mempool_id)); });
}

#if GPUMEM_TORCH_HAS_POOL_USE_COUNT
int TorchAllocator::getPoolUseCount(DeviceIndex device, MempoolId mempool_id) {
  return this->device(device).pool_use_count(torch_compat::to_gpumem(mempool_id));
}
#endif

#if GPUMEM_TORCH_HAS_ENSURE_EXISTS_AND_INCREF_POOL
// What 2.6 and 2.7 call createOrIncrefPool (MemPool's constructor); it has no allocator argument.
void TorchAllocator::ensureExistsAndIncrefPool(DeviceIndex device, MempoolId mempool_id) {
  gpumem::DeviceAllocator& d = this->device(device);
  with_c10_errors([&] { d.create_pool(torch_compat::to_gpumem(mempool_id)); });
}
#endif

#if GPUMEM_TORCH_HAS_CREATE_OR_INCREF_POOL
// gpumem itself passed as the allocator is the same as none: the pool's segments come from gpumem's
// backend. An allocator for a pool that exists already is refused by the core (native asserts).
void TorchAllocator::createOrIncrefPool(DeviceIndex device, MempoolId mempool_id, GPUMEM_POOL_ALLOCATOR_TYPE allocator) {
  gpumem::DeviceAllocator& d = this->device(device);
  const void* other = address_of(allocator);
  std::shared_ptr<SegmentSource> source;
  if (other != nullptr && other != this) {
    source = std::make_shared<TorchPoolSource>(std::move(allocator), device, *context_, history_);
  }
  with_c10_errors([&] { d.create_pool(torch_compat::to_gpumem(mempool_id), std::move(source)); });
}
#endif

// use_on_oom: while the pool is held, its cached free blocks may serve a default-pool request that
// could not get new memory (core/private_pools.cpp). 2.11 passes the flag (MemPool's destructor
// may clear it); earlier releases only set it.
#if GPUMEM_TORCH_HAS_SET_USE_ON_OOM_FLAG
void TorchAllocator::setUseOnOOM(DeviceIndex device, MempoolId mempool_id, bool use_on_oom) {
  gpumem::DeviceAllocator& d = this->device(device);
  with_c10_errors([&] { d.set_pool_option(torch_compat::to_gpumem(mempool_id), PoolOption::kUseOnOom, use_on_oom); });
}
#elif GPUMEM_TORCH_HAS_SET_USE_ON_OOM
void TorchAllocator::setUseOnOOM(DeviceIndex device, MempoolId mempool_id) {
  gpumem::DeviceAllocator& d = this->device(device);
  with_c10_errors([&] { d.set_pool_option(torch_compat::to_gpumem(mempool_id), PoolOption::kUseOnOom, true); });
}
#endif

// no_split: the pool's blocks are handed out whole, one block per segment.
#if GPUMEM_TORCH_HAS_SET_NO_SPLIT
void TorchAllocator::setNoSplit(DeviceIndex device, MempoolId mempool_id) {
  gpumem::DeviceAllocator& d = this->device(device);
  with_c10_errors([&] { d.set_pool_option(torch_compat::to_gpumem(mempool_id), PoolOption::kNoSplit, true); });
}
#endif

// True when the pool's allocated blocks are exactly `expected` (cudagraph trees' liveness check).
bool TorchAllocator::checkPoolLiveAllocations(DeviceIndex device, MempoolId mempool_id,
                                              const std::unordered_set<void*>& expected) {
  const gpumem::DeviceAllocator* d = with_c10_errors([&] { return core_.existing(device); });
  if (!d) return expected.empty();
  const PoolId pool = torch_compat::to_gpumem(mempool_id);
  std::size_t live = 0;
  for (const SegmentInfo& segment : d->snapshot()) {
    if (!(segment.pool == pool)) continue;
    for (const BlockInfo& block : segment.blocks) {
      if (block.state != BlockInfo::kAllocated) continue;
      if (expected.count(reinterpret_cast<void*>(block.addr)) == 0) return false;
      ++live;
    }
  }
  return live == expected.size();
}

}  // namespace gpumem
