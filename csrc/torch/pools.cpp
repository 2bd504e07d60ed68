// Private pools: CUDA graph capture, torch.cuda.MemPool, torch.compile's cudagraph trees.
//
// Holders, as native counts them: createOrIncrefPool (MemPool's constructor) and every
// beginAllocateToPool add one; releasePool drops one (a graph's reset, MemPool's destructor, the
// end of use_mem_pool after endAllocateToPool). A pool nobody holds gives its cache back.
#include <type_traits>

#include "torch/allocator.h"
#include "torch/error_bridge.h"

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
void TorchAllocator::createOrIncrefPool(DeviceIndex device, MempoolId mempool_id, GPUMEM_POOL_ALLOCATOR_TYPE allocator) {
  const void* other = address_of(allocator);
  TORCH_CHECK(other == nullptr || other == this,
              "gpumem: a torch.cuda.MemPool with its own allocator is not supported while gpumem is installed; "
              "create the MemPool without an allocator argument (it then uses gpumem, under its limit)");
  gpumem::DeviceAllocator& d = this->device(device);
  with_c10_errors([&] { d.create_pool(torch_compat::to_gpumem(mempool_id)); });
}
#endif

// use_on_oom asks the allocator to serve a request from this pool when the default pool is out of
// memory. gpumem's fallback chain never borrows from a private pool, so the flag is accepted and
// has no effect; a warning says so, since code counting on it sees an OOM that native would avoid.
#if GPUMEM_TORCH_HAS_SET_USE_ON_OOM_FLAG
void TorchAllocator::setUseOnOOM(DeviceIndex /*device*/, MempoolId /*mempool_id*/, bool use_on_oom) {
  if (use_on_oom) {
    TORCH_WARN_ONCE("gpumem: MemPool(use_on_oom=True) has no effect under gpumem");
  }
}
#elif GPUMEM_TORCH_HAS_SET_USE_ON_OOM
void TorchAllocator::setUseOnOOM(DeviceIndex /*device*/, MempoolId /*mempool_id*/) {
  TORCH_WARN_ONCE("gpumem: MemPool(use_on_oom=True) has no effect under gpumem");
}
#endif

// no_split keeps a pool's blocks whole. gpumem splits blocks the same way in every pool; what fits
// under the limit is unchanged, only the layout differs, so the request is accepted with a warning.
#if GPUMEM_TORCH_HAS_SET_NO_SPLIT
void TorchAllocator::setNoSplit(DeviceIndex /*device*/, MempoolId /*mempool_id*/) {
  TORCH_WARN_ONCE("gpumem: MemPool(no_split=True) has no effect under gpumem: its blocks may be split");
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
