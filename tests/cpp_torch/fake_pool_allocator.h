// A torch CUDAAllocator standing in for a MemPool's own allocator (what CUDAPluggableAllocator
// wraps: a user's alloc/free functions, NCCL's). Only raw_alloc and raw_delete are meant to be
// called; they hand out addresses nothing can dereference, from a region no simulated device uses,
// count the calls, note the device current at each (through the test's FakeCudaContext), and can
// be told to refuse (nullptr), to throw, or to throw torch's OutOfMemoryError. Everything else
// throws, so a call gpumem should never make fails the test.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <map>

#include "adapter_fixture.h"

namespace gpumem::testing {

class FakePoolAllocator final : public c10::cuda::CUDACachingAllocator::CUDAAllocator {
 public:
  using DataPtr = c10::DataPtr;
  using DeviceIndex = c10::DeviceIndex;
  using MempoolId = c10::cuda::MempoolId_t;
  static constexpr std::uintptr_t kBase = std::uintptr_t{7} << 52;

  // `context` is the adapter's: the device it says is current is the one each call ran on.
  explicit FakePoolAllocator(FakeCudaContext& context) : context_(context) {}

  void* raw_alloc(size_t nbytes) override {
    ++raw_alloc_calls;
    alloc_devices.push_back(context_.device);
    if (throw_next > 0) {
      --throw_next;
      TORCH_CHECK(false, "the fake MemPool allocator broke");
    }
    if (oom_next > 0) {
      --oom_next;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "the fake MemPool allocator is out of memory");
    }
    if (refuse_next > 0 || nbytes > capacity - in_use) {
      if (refuse_next > 0) --refuse_next;
      return nullptr;
    }
    const std::uintptr_t addr = next_;
    next_ += (nbytes + 0xFFFFF) & ~std::uintptr_t{0xFFFFF};
    live_.emplace(addr, nbytes);
    in_use += nbytes;
    return reinterpret_cast<void*>(addr);
  }
  void raw_delete(void* ptr) override {
    ++raw_delete_calls;
    delete_devices.push_back(context_.device);
    auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
    TORCH_CHECK(it != live_.end(), "the fake MemPool allocator did not hand out ", ptr);
    in_use -= it->second;
    live_.erase(it);
  }
  bool owns(const void* ptr) const {
    auto it = live_.upper_bound(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == live_.begin()) return false;
    --it;
    return reinterpret_cast<std::uintptr_t>(ptr) < it->first + it->second;
  }

  int raw_alloc_calls = 0;
  int raw_delete_calls = 0;
  std::vector<int> alloc_devices;
  std::vector<int> delete_devices;
  int refuse_next = 0;
  int throw_next = 0;
  int oom_next = 0;
  std::size_t capacity = std::size_t{1} << 40;
  std::size_t in_use = 0;

  // ---- not used by gpumem ----
  DataPtr allocate(size_t) override { unused(); }
  c10::DeleterFnPtr raw_deleter() const override { unused(); }
  void copy_data(void*, const void*, size_t) const override { unused(); }
  void* raw_alloc_with_stream(size_t, cudaStream_t) override { unused(); }
  void init(int) override {}
  bool initialized() override { return true; }
  std::string name() override { return "fake-pool-allocator"; }
#if GPUMEM_TORCH_HAS_GET_MEMORY_FRACTION
  double getMemoryFraction(DeviceIndex) override { unused(); }
#endif
  void setMemoryFraction(double, DeviceIndex) override { unused(); }
#if GPUMEM_TORCH_HAS_ENABLE
  void enable(bool) override { unused(); }
  bool isEnabled() const override { return true; }
#endif
#if GPUMEM_TORCH_HAS_EMPTY_CACHE_POOL
  void emptyCache(MempoolId) override { unused(); }
#else
  void emptyCache() override { unused(); }
#endif
  void cacheInfo(DeviceIndex, size_t*) override { unused(); }
  void* getBaseAllocation(void*, size_t*) override { unused(); }
  void recordStream(const DataPtr&, c10::cuda::CUDAStream) override { unused(); }
  c10::cuda::CUDACachingAllocator::DeviceStats getDeviceStats(DeviceIndex) override { unused(); }
  void resetAccumulatedStats(DeviceIndex) override { unused(); }
  void resetPeakStats(DeviceIndex) override { unused(); }
#if GPUMEM_TORCH_HAS_EXPANDABLE_SEGMENT_SIZES
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex) override {
    unused();
  }
#endif
#if GPUMEM_TORCH_HAS_INCLUDE_TRACES
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(MempoolId, bool) override { unused(); }
#elif GPUMEM_TORCH_HAS_SNAPSHOT_POOL
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(MempoolId) override { unused(); }
#else
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot() override { unused(); }
#endif
  void beginAllocateToPool(DeviceIndex, MempoolId, std::function<bool(cudaStream_t)>) override { unused(); }
  void endAllocateToPool(DeviceIndex, MempoolId) override { unused(); }
  void releasePool(DeviceIndex, MempoolId) override { unused(); }
#if GPUMEM_TORCH_HAS_SHARE_IPC_HANDLE
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void*) override { unused(); }
#endif
  std::shared_ptr<void> getIpcDevPtr(std::string) override { unused(); }
  void recordHistory(bool, c10::cuda::CUDACachingAllocator::CreateContextFn, size_t,
                     c10::cuda::CUDACachingAllocator::RecordContext GPUMEM_CLEAR_HISTORY_PARAM
                         GPUMEM_SKIP_ACTIONS_PARAM) override {
    (void)GPUMEM_CLEAR_HISTORY_ARG;
    (void)GPUMEM_SKIP_ACTIONS_ARG;
    unused();
  }
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver) override { unused(); }
#if GPUMEM_TORCH_HAS_OOM_REJECTION_OBSERVER
  void attachOomRejectionObserver(c10::cuda::CUDACachingAllocator::OomRejectionObserver) override { unused(); }
#endif
  void attachAllocatorTraceTracker(c10::cuda::CUDACachingAllocator::AllocatorTraceTracker) override { unused(); }
  void enablePeerAccess(DeviceIndex, DeviceIndex) override { unused(); }
  cudaError_t memcpyAsync(void*, int, const void*, int, size_t, cudaStream_t, bool) override { unused(); }
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(DeviceIndex, MempoolId) override {
    unused();
  }
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      DeviceIndex, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState>) override {
    unused();
  }

 private:
  [[noreturn]] static void unused() { TORCH_CHECK(false, "FakePoolAllocator: gpumem called a method it should not"); }

  FakeCudaContext& context_;
  std::uintptr_t next_ = kBase;
  std::map<std::uintptr_t, std::size_t> live_;
};

}  // namespace gpumem::testing
