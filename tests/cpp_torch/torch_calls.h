// The adapter's torch methods whose parameters differ between the torch releases gpumem builds
// against, called the one way each test means on every release (see csrc/torch/compat.h and
// docs/compatibility.md). A test of a method or parameter a release lacks altogether is compiled
// under its GPUMEM_TORCH_HAS_* macro instead.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "torch/allocator.h"

namespace gpumem::testing {

using TorchRecordContext = c10::cuda::CUDACachingAllocator::RecordContext;

// recordHistory. clear_history is a parameter from 2.8 on (GPUMEM_TORCH_HAS_CLEAR_HISTORY); before,
// torch never clears, and it is ignored: the tests that depend on clearing are compiled under the
// macro, the others ask for it on an adapter with nothing recorded.
inline void record_history(TorchAllocator& adapter, bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn recorder,
                           std::size_t max_entries, TorchRecordContext when, bool clear_history = false) {
#if GPUMEM_TORCH_HAS_CLEAR_HISTORY && GPUMEM_TORCH_HAS_SKIP_ACTIONS
  adapter.recordHistory(enabled, recorder, max_entries, when, clear_history, {});
#elif GPUMEM_TORCH_HAS_CLEAR_HISTORY
  adapter.recordHistory(enabled, recorder, max_entries, when, clear_history);
#else
  (void)clear_history;
  adapter.recordHistory(enabled, recorder, max_entries, when);
#endif
}

#if GPUMEM_TORCH_HAS_SKIP_ACTIONS  // skip_actions: from 2.11 on
inline void record_history(TorchAllocator& adapter, bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn recorder,
                           std::size_t max_entries, TorchRecordContext when, bool clear_history,
                           const std::vector<std::string>& skip_actions) {
  adapter.recordHistory(enabled, recorder, max_entries, when, clear_history, skip_actions);
}
#endif

inline void stop_history(TorchAllocator& adapter) { record_history(adapter, false, nullptr, 0, TorchRecordContext::NEVER); }

// emptyCache(pool) from 2.8 on (GPUMEM_TORCH_HAS_EMPTY_CACHE_POOL). Before, torch's emptyCache takes
// no pool and does what the default id does: it empties the default pool and every private pool
// nobody holds. Tests that `pool` empties that pool alone are compiled under the macro.
inline void empty_cache(TorchAllocator& adapter, TorchAllocator::MempoolId pool = {0, 0}) {
#if GPUMEM_TORCH_HAS_EMPTY_CACHE_POOL
  adapter.emptyCache(pool);
#else
  (void)pool;
  adapter.emptyCache();
#endif
}

// (free, total) of a device under the cap, as torch.cuda.mem_get_info shows them under gpumem:
// torch asks getMemoryInfo from 2.10 on (GPUMEM_TORCH_HAS_GET_MEMORY_INFO); before, gpumem's Python
// module passes the device's own reading to capped_view (capped_mem_info in csrc/python/module.cpp).
inline std::pair<std::size_t, std::size_t> memory_info(TorchAllocator& adapter, c10::DeviceIndex device) {
#if GPUMEM_TORCH_HAS_GET_MEMORY_INFO
  return adapter.getMemoryInfo(device);
#else
  return adapter.capped_view(device, adapter.core().device(device).device_mem_info());
#endif
}

// MemPool's constructor without an allocator of its own: ensureExistsAndIncrefPool in 2.6 and 2.7,
// createOrIncrefPool from 2.8 on.
inline void create_or_incref_pool(TorchAllocator& adapter, c10::DeviceIndex device, TorchAllocator::MempoolId pool) {
#if GPUMEM_TORCH_HAS_CREATE_OR_INCREF_POOL
  adapter.createOrIncrefPool(device, pool, nullptr);
#else
  adapter.ensureExistsAndIncrefPool(device, pool);
#endif
}

#if GPUMEM_TORCH_HAS_CREATE_OR_INCREF_POOL  // a MemPool with an allocator of its own: from 2.8 on
// The allocator as createOrIncrefPool takes it: a raw pointer before 2.11, a shared_ptr since.
inline GPUMEM_POOL_ALLOCATOR_TYPE pool_allocator_arg(
    const std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>& allocator) {
#if GPUMEM_TORCH_HAS_POOL_ALLOCATOR_SHARED_PTR
  return allocator;
#else
  return allocator.get();
#endif
}
#endif

#if GPUMEM_TORCH_HAS_SET_USE_ON_OOM  // from 2.8 on; 2.11 added the flag, before it only sets
inline void set_use_on_oom(TorchAllocator& adapter, c10::DeviceIndex device, TorchAllocator::MempoolId pool) {
#if GPUMEM_TORCH_HAS_SET_USE_ON_OOM_FLAG
  adapter.setUseOnOOM(device, pool, true);
#else
  adapter.setUseOnOOM(device, pool);
#endif
}
#endif

}  // namespace gpumem::testing
