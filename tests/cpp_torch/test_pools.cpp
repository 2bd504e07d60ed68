// Private pools as CUDA graph capture and torch.cuda.MemPool drive them.
#include <catch2/catch.hpp>

#include <memory>

#include "adapter_fixture.h"

using namespace gpumem;
using namespace gpumem::testing;

namespace {

constexpr c10::cuda::MempoolId_t kPool{1, 0};
constexpr StreamId kCaptureStream = 5;

auto capture_stream_only() {
  return [](cudaStream_t stream) { return reinterpret_cast<StreamId>(stream) == kCaptureStream; };
}

// The pool of the segment holding the DataPtr's memory, from the core's snapshot.
PoolId pool_of(SimAdapter& sim, const c10::DataPtr& ptr) {
  const auto addr = address_of(ptr);
  for (const SegmentInfo& s : sim.core_device().snapshot()) {
    if (s.addr <= addr && addr < s.addr + s.size) return s.pool;
  }
  FAIL("no segment holds the DataPtr");
  return {};
}

}  // namespace

TEST_CASE("between begin and endAllocateToPool the requests the filter accepts come from the pool", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  c10::DataPtr captured = sim.adapter.allocate(1 * MiB);
  sim.context.stream = 0;
  c10::DataPtr other = sim.adapter.allocate(1 * MiB);
  sim.adapter.endAllocateToPool(0, kPool);
  sim.context.stream = kCaptureStream;
  c10::DataPtr after = sim.adapter.allocate(1 * MiB);
  REQUIRE(pool_of(sim, captured) == PoolId{1, 0});
  REQUIRE(pool_of(sim, other).is_default());
  REQUIRE(pool_of(sim, after).is_default());
}

TEST_CASE("beginAllocateToPool creates the pool and holds it until releasePool", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.adapter.endAllocateToPool(0, kPool);
  REQUIRE(sim.adapter.getPoolUseCount(0, kPool) == 1);
  sim.adapter.releasePool(0, kPool);
  REQUIRE(sim.adapter.getPoolUseCount(0, kPool) == 0);
}

TEST_CASE("createOrIncrefPool adds a holder and each releasePool drops one", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.createOrIncrefPool(0, kPool, nullptr);
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.adapter.endAllocateToPool(0, kPool);
  REQUIRE(sim.adapter.getPoolUseCount(0, kPool) == 2);
  sim.adapter.releasePool(0, kPool);
  REQUIRE(sim.adapter.getPoolUseCount(0, kPool) == 1);
}

TEST_CASE("a MemPool with an allocator of its own is refused", "[torch][pools]") {
  SimAdapter sim;
  SimAdapter other;
  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> foreign(&other.adapter, [](auto*) {});
  REQUIRE_THROWS_WITH(sim.adapter.createOrIncrefPool(0, kPool, foreign), Catch::Contains("its own allocator"));
}

TEST_CASE("a released pool's cache goes back to the device", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  { c10::DataPtr captured = sim.adapter.allocate(30 * MiB); }
  sim.adapter.endAllocateToPool(0, kPool);
  REQUIRE(sim.reserved() == 30 * MiB);
  sim.adapter.releasePool(0, kPool);
  REQUIRE(sim.reserved() == 0);
}

TEST_CASE("a held pool's cache survives emptyCache", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  { c10::DataPtr captured = sim.adapter.allocate(30 * MiB); }
  sim.adapter.endAllocateToPool(0, kPool);
  sim.adapter.emptyCache(kPool);
  REQUIRE(sim.reserved() == 30 * MiB);
}

TEST_CASE("a pool block outliving its pool's release is freed normally", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  c10::DataPtr captured = sim.adapter.allocate(30 * MiB);
  sim.adapter.endAllocateToPool(0, kPool);
  sim.adapter.releasePool(0, kPool);
  captured.clear();
  sim.adapter.emptyCache({0, 0});
  REQUIRE(sim.reserved() == 0);
  sim.core_device().check_invariants();
}

TEST_CASE("checkPoolLiveAllocations is true exactly when the pool's allocated blocks are the expected set", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  c10::DataPtr a = sim.adapter.allocate(1 * MiB);
  c10::DataPtr b = sim.adapter.allocate(3 * MiB);
  sim.adapter.endAllocateToPool(0, kPool);
  REQUIRE(sim.adapter.checkPoolLiveAllocations(0, kPool, {a.get(), b.get()}));
  REQUIRE_FALSE(sim.adapter.checkPoolLiveAllocations(0, kPool, {a.get()}));
  int elsewhere = 0;
  REQUIRE_FALSE(sim.adapter.checkPoolLiveAllocations(0, kPool, {a.get(), b.get(), &elsewhere}));
}

TEST_CASE("raw_delete frees a pool block whose DataPtr let go of it", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  c10::DataPtr captured = sim.adapter.allocate(3 * MiB);
  sim.adapter.endAllocateToPool(0, kPool);
  void* ptr = captured.get();
  captured.release_context();  // what cudagraph trees do with outputs they manage
  sim.adapter.raw_delete(ptr);
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 0);
}

TEST_CASE("use_on_oom and no_split are accepted", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.createOrIncrefPool(0, kPool, nullptr);
  sim.adapter.setUseOnOOM(0, kPool, false);
  sim.adapter.setNoSplit(0, kPool);
  REQUIRE(sim.adapter.getPoolUseCount(0, kPool) == 1);
}
