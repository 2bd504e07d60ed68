// The torch adapter: PyTorch's CUDA allocator interface (CUDAAllocator) over gpumem's core.
//
// Layers: torch calls TorchAllocator; it calls CachingAllocator / DeviceAllocator (the cap, the
// pools, the statistics) through a TracingBackend wrapped around the real backend, and the CUDA
// runtime only for what the core has no notion of (peer copies, device-to-device copies).
//
// Notes:
//  - The hot path. allocate() is: current device and stream (two virtual calls to CudaContext),
//    the core's malloc, and a DataPtr whose context is the gpumem::Block*, so the deleter frees with
//    no lookup. Two relaxed checks guard the rest: history active, and "the block is in a private
//    pool" (then it is entered in PoolBlocks). No maps, no std::function, no allocation of ours.
//  - The deleter is a plain function (torch stores a function pointer). It reaches its adapter
//    only on the slow path, through a process-wide list of live adapters (see allocator.cpp).
//    It never throws: it runs inside torch's noexcept destructors, so a failure is a warning.
//  - Private-pool DataPtrs carry the block's address (tagged in the low bits), not the Block*, and
//    free by address as native's do: a checkpoint restore (checkpoint.cpp) frees and re-cuts the
//    pool, so the Block behind an address changes while tensors made before the restore live on
//    and must free the block that stands at their address now.
//  - Device and stream come through CudaContext so the tests run with no GPU and no driver.
//  - Nothing reaches CUDA before torch's lazy init or the first allocation (Note [no CUDA before
//    first use], backends/cuda_backend.cpp): per-device tables have room for every device torch can
//    number, and init() runs the core's deferred setup (the settings read at install, torch/startup.h).
//  - name() is "native": gpumem stands in for torch's native allocator, and torch's settings
//    parser refuses `backend:native` in PYTORCH_CUDA_ALLOC_CONF unless the allocator is so named.
//  - Errors leave as c10 errors, which Python maps: the core's OutOfMemoryError becomes
//    c10::OutOfMemoryError (torch.OutOfMemoryError) with gpumem's message, LimitSpecError and
//    DeviceError become c10::ValueError, anything else c10::Error.
//  - enable(false) turns caching off as native does: each allocation comes from the device and
//    goes back to it when freed, outside the statistics, and the cap still counts it
//    (core/uncached.cpp). DataPtrs made before keep returning to the cache.
//  - One file per concern: allocator.cpp (allocate, free, raw, streams, OOM, lifecycle),
//    memory_queries.cpp (stats, fraction, free memory, cache), pools.cpp and pool_source.cpp (a
//    MemPool's own allocator), checkpoint.cpp, snapshot.cpp (snapshot, history), cuda_ops.cpp
//    (IPC, peer access, copies).
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/caching_allocator.h"
#include "torch/compat.h"
#include "torch/error_bridge.h"
#include "torch/cuda_context.h"
#include "torch/history.h"
#include "torch/pool_blocks.h"
#include "torch/tracing_backend.h"

namespace gpumem {

// What getIpcDevPtr opened, shared with the deleters of what it returned (ipc.cpp).
class IpcOpened;
std::shared_ptr<IpcOpened> make_ipc_opened(Backend& backend);

class TorchAllocator final : public torch_compat::CUDAAllocator {
 public:
  static constexpr int kMaxDevices = C10_COMPILE_TIME_MAX_GPUS;

  using DataPtr = c10::DataPtr;
  using DeviceIndex = c10::DeviceIndex;
  using MempoolId = torch_compat::TorchPoolId;
  using SnapshotInfo = c10::cuda::CUDACachingAllocator::SnapshotInfo;
  using AllocatorState = c10::cuda::CUDACachingAllocator::AllocatorState;
  using CheckpointDelta = c10::cuda::CUDACachingAllocator::CheckpointDelta;
  using OutOfMemoryObserver = c10::cuda::CUDACachingAllocator::OutOfMemoryObserver;
  using AllocatorTraceTracker = c10::cuda::CUDACachingAllocator::AllocatorTraceTracker;
#if GPUMEM_TORCH_HAS_SHARE_IPC_HANDLE
  using ShareableHandle = c10::cuda::CUDACachingAllocator::ShareableHandle;
#endif

  TorchAllocator(Backend& backend, std::unique_ptr<CudaContext> context, AllocatorConfig defaults = {});
  ~TorchAllocator() override;
  TorchAllocator(const TorchAllocator&) = delete;
  TorchAllocator& operator=(const TorchAllocator&) = delete;

  CachingAllocator& core() { return core_; }

  // ---- allocation (allocator.cpp) ----
  DataPtr allocate(size_t size) override;
  c10::DeleterFnPtr raw_deleter() const override;
#if GPUMEM_TORCH_HAS_IS_SIMPLE_DATA_PTR
  // gpumem's DataPtrs carry a Block*, not the address, as context; they are still plain.
  bool is_simple_data_ptr(const DataPtr& ptr) const override;
#endif
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void recordStream(const DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  // The same with the stream as gpumem knows it. DataPtrs gpumem did not make are ignored.
  void record_stream(const DataPtr& ptr, StreamId stream);
  static bool owns(const DataPtr& ptr);

  void init(int device_count) override;
  bool initialized() override;
  void enable(bool value) GPUMEM_OVERRIDE_IF(GPUMEM_TORCH_HAS_ENABLE);
  bool isEnabled() const GPUMEM_OVERRIDE_IF(GPUMEM_TORCH_HAS_ENABLE);
  std::string name() override;

  void attachOutOfMemoryObserver(OutOfMemoryObserver observer) override;
#if GPUMEM_TORCH_HAS_OOM_REJECTION_OBSERVER
  void attachOomRejectionObserver(c10::cuda::CUDACachingAllocator::OomRejectionObserver observer) override;
#endif
  void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) override;

  // ---- what torch asks about memory (memory_queries.cpp) ----
  torch_compat::TorchDeviceStats getDeviceStats(DeviceIndex device) override;
  void resetAccumulatedStats(DeviceIndex device) override;
  void resetPeakStats(DeviceIndex device) override;
  // torch.cuda.set_per_process_memory_fraction and its read-back. Setting makes the limit that
  // share of the device's total memory; reading gives the fraction set last, as natively: by
  // setMemoryFraction, else by torch's per_process_memory_fraction at start-up (1 when neither
  // did), whatever else set the limit since (GPUMEM_LIMIT, gpumem.set_limit). The limit in force
  // is the core's (gpumem.get_limit()).
  double getMemoryFraction(DeviceIndex device) GPUMEM_OVERRIDE_IF(GPUMEM_TORCH_HAS_GET_MEMORY_FRACTION);
  void setMemoryFraction(double fraction, DeviceIndex device) override;
  // torch's per_process_memory_fraction as the start-up applied it to every device (torch/startup.h).
  void set_startup_fraction(double fraction);
#if GPUMEM_TORCH_HAS_EMPTY_CACHE_POOL
  void emptyCache(MempoolId mempool_id) override;
#else
  void emptyCache() override;
#endif
  void cacheInfo(DeviceIndex device, size_t* largest_block) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  // (free, total) of the device under the cap, from the device's own `mem`; what
  // torch.cuda.mem_get_info shows under gpumem.
  std::pair<size_t, size_t> capped_view(DeviceIndex device, MemInfo mem);
#if GPUMEM_TORCH_HAS_GET_MEMORY_INFO
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override;
#endif
#if GPUMEM_TORCH_HAS_EXPANDABLE_SEGMENT_SIZES
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex device) override;
#endif

  // ---- private pools: CUDA graphs, MemPool (pools.cpp) ----
  void beginAllocateToPool(DeviceIndex device, MempoolId mempool_id, std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(DeviceIndex device, MempoolId mempool_id) override;
  void releasePool(DeviceIndex device, MempoolId mempool_id) override;
#if GPUMEM_TORCH_HAS_POOL_USE_COUNT
  int getPoolUseCount(DeviceIndex device, MempoolId mempool_id) override;
#endif
#if GPUMEM_TORCH_HAS_ENSURE_EXISTS_AND_INCREF_POOL
  void ensureExistsAndIncrefPool(DeviceIndex device, MempoolId mempool_id) override;
#endif
#if GPUMEM_TORCH_HAS_CREATE_OR_INCREF_POOL
  void createOrIncrefPool(DeviceIndex device, MempoolId mempool_id, GPUMEM_POOL_ALLOCATOR_TYPE allocator) override;
#endif
#if GPUMEM_TORCH_HAS_SET_USE_ON_OOM_FLAG
  void setUseOnOOM(DeviceIndex device, MempoolId mempool_id, bool use_on_oom) override;
#elif GPUMEM_TORCH_HAS_SET_USE_ON_OOM
  void setUseOnOOM(DeviceIndex device, MempoolId mempool_id) override;
#endif
#if GPUMEM_TORCH_HAS_SET_NO_SPLIT
  void setNoSplit(DeviceIndex device, MempoolId mempool_id) override;
#endif
  bool checkPoolLiveAllocations(DeviceIndex device, MempoolId mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override;

  // ---- cudagraph-tree checkpoints (checkpoint.cpp) ----
  std::shared_ptr<AllocatorState> getCheckpointState(DeviceIndex device, MempoolId id) override;
  CheckpointDelta setCheckpointPoolState(DeviceIndex device, std::shared_ptr<AllocatorState> state) override;

  // ---- snapshot and history (snapshot.cpp) ----
#if GPUMEM_TORCH_HAS_INCLUDE_TRACES
  SnapshotInfo snapshot(MempoolId mempool_id, bool include_traces) override;
#elif GPUMEM_TORCH_HAS_SNAPSHOT_POOL
  SnapshotInfo snapshot(MempoolId mempool_id) override;
#else
  SnapshotInfo snapshot() override;
#endif
  SnapshotInfo snapshot_of(MempoolId mempool_id, bool include_traces);
  void recordHistory(bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, c10::cuda::CUDACachingAllocator::RecordContext when
                     GPUMEM_CLEAR_HISTORY_PARAM GPUMEM_SKIP_ACTIONS_PARAM) override;
  bool isHistoryEnabled() override;
#if GPUMEM_TORCH_HAS_COMPILE_CONTEXT
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
#endif
#if GPUMEM_TORCH_HAS_USER_METADATA
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
#endif

  // ---- tensors sent to and received from other processes (ipc.cpp) ----
#if GPUMEM_TORCH_HAS_SHARE_IPC_HANDLE
  ShareableHandle shareIpcHandle(void* ptr) override;
#endif
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  // Handles opened here and not yet let go (for tests).
  std::size_t ipc_opened() const;

  // ---- what gpumem leaves to CUDA (cuda_ops.cpp) ----
  void copy_data(void* dest, const void* src, size_t count) const override;
  void enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;

 private:
  static void delete_block(void* ctx);
  static void* context_of(const Block* block);
  static TorchAllocator& owner_of(const Block* block);
  static Block* take_pool_block(std::uintptr_t addr, TorchAllocator** owner);
  static void free_pool_address(std::uintptr_t addr);
  static void free_uncached_address(void* ptr);
  void* malloc_uncached(int device, size_t size);
  bool free_uncached(void* ptr);

  Block* malloc_block(int device, size_t size, StreamId stream);
  Block* malloc_recorded(int device, size_t size, StreamId stream, bool raw);
  void* raw_alloc_on(int device, size_t nbytes, StreamId stream);
  // While history is active: the calling thread's request, with its stack at `level`, for the
  // segment entries the core's work causes (see TracingBackend::Request).
  std::optional<TracingBackend::Request> request_scope(StreamId stream, History::RecordContext level);
  // Runs a core call; its OutOfMemoryError is reported (observers, history, with `context`'s stack
  // where there is one) and rethrown as torch's, any other error as a c10 error. A pointer, so
  // that a call with no stack makes no Context on its way.
  template <class F>
  decltype(auto) call_core(StreamId stream, const History::Context* context, F&& f) {
    try {
      return f();
    } catch (const OutOfMemoryError& error) {
      report_oom(error, stream, context ? *context : History::Context());
    } catch (...) {
      rethrow_as_c10_error();
    }
  }
  // The core's free, told to the history and the profiler; straight to the core when nobody
  // listens (the hot path, inline in raw_delete).
  void free_recorded(Block* block) {
    if (C10_LIKELY(!history_.active() && !c10::memoryProfilingEnabled())) return CachingAllocator::free(block);
    free_told(block);
  }
  void free_told(Block* block);  // free_recorded's path while the history or the profiler listens
  History::Context record_free(int device, const Block* block);
  void report_to_profiler(int device, void* ptr, std::int64_t delta);
  [[noreturn]] void report_oom(const OutOfMemoryError& error, StreamId stream, const History::Context& context);
  gpumem::DeviceAllocator& device(DeviceIndex device);
  void record(History::Action action, int device, const void* ptr, size_t size, StreamId stream, PoolId pool,
              History::Context context = nullptr);

  std::unique_ptr<CudaContext> context_;
  History history_;
  TracingBackend traced_;
  CachingAllocator core_;
  PoolBlocks pool_blocks_;
  std::array<std::atomic<double>, kMaxDevices> fractions_;  // what getMemoryFraction reads back
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  std::mutex observers_mutex_;
  std::vector<OutOfMemoryObserver> oom_observers_;
  std::shared_ptr<IpcOpened> ipc_opened_;  // what getIpcDevPtr opened (ipc.cpp)
};

}  // namespace gpumem
