// Private pools as CUDA graph capture and torch.cuda.MemPool drive them.
#include <catch2/catch.hpp>

#include <memory>

#include "adapter_fixture.h"
#include "fake_pool_allocator.h"
#include "torch_calls.h"
#include "torch_settings.h"

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
  create_or_incref_pool(sim.adapter, 0, kPool);
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.adapter.endAllocateToPool(0, kPool);
  REQUIRE(sim.adapter.getPoolUseCount(0, kPool) == 2);
  sim.adapter.releasePool(0, kPool);
  REQUIRE(sim.adapter.getPoolUseCount(0, kPool) == 1);
}

TEST_CASE("a released pool's cache goes back to the device", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  { c10::DataPtr captured = sim.adapter.allocate(30 * MiB); }
  sim.adapter.endAllocateToPool(0, kPool);
  REQUIRE(sim.reserved() == 30 * MiB);
  sim.adapter.releasePool(0, kPool);  // as native: the pool is freeable now, its cache still there
  REQUIRE(sim.reserved() == 30 * MiB);
  empty_cache(sim.adapter, kPool);
  REQUIRE(sim.reserved() == 0);
}

TEST_CASE("a held pool's cache survives emptyCache", "[torch][pools]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  { c10::DataPtr captured = sim.adapter.allocate(30 * MiB); }
  sim.adapter.endAllocateToPool(0, kPool);
  empty_cache(sim.adapter, kPool);
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
  empty_cache(sim.adapter);
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

#if GPUMEM_TORCH_HAS_EMPTY_CACHE_POOL  // emptyCache of one pool: from 2.8 on
TEST_CASE("MemPool's destructor (releasePool, then emptyCache of its id) empties its pool only", "[torch][pools]") {
  SimAdapter sim;
  { c10::DataPtr plain = sim.adapter.allocate(30 * MiB); }
  create_or_incref_pool(sim.adapter, 0, kPool);
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  { c10::DataPtr pooled = sim.adapter.allocate(12 * MiB); }
  sim.adapter.endAllocateToPool(0, kPool);
  sim.adapter.releasePool(0, kPool);  // use_mem_pool's end
  REQUIRE(sim.reserved() == 42 * MiB);
  sim.adapter.releasePool(0, kPool);
  empty_cache(sim.adapter, kPool);
  REQUIRE(sim.reserved() == 30 * MiB);
  REQUIRE(sim.adapter.getPoolUseCount(0, kPool) == 0);
}
#endif

// ---- a MemPool with its own allocator ----

#if GPUMEM_TORCH_HAS_CREATE_OR_INCREF_POOL  // createOrIncrefPool takes the allocator: from 2.8 on

namespace {

using TorchAllocatorPtr = std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>;

// kPool created with a FakePoolAllocator and the target for kCaptureStream, which is current.
struct PoolWithAllocator {
  explicit PoolWithAllocator(SimAdapter& sim, int device = 0)
      : sim(sim), device(device), fake(std::make_shared<FakePoolAllocator>(sim.context)) {
    sim.context.device = device;
    sim.adapter.createOrIncrefPool(device, kPool, pool_allocator_arg(fake));
    sim.adapter.beginAllocateToPool(device, kPool, capture_stream_only());
    sim.context.stream = kCaptureStream;
  }
  // What MemPool's destructor does, after use_mem_pool ended.
  void destroy() {
    sim.adapter.endAllocateToPool(device, kPool);
    sim.adapter.releasePool(device, kPool);
    sim.adapter.releasePool(device, kPool);
    empty_cache(sim.adapter, kPool);
  }
  SimAdapter& sim;
  int device;
  std::shared_ptr<FakePoolAllocator> fake;
};

}  // namespace

TEST_CASE("a MemPool's own allocator serves its pool's segments", "[torch][pools][allocator]") {
  SimAdapter sim;
  PoolWithAllocator pool(sim);
  c10::DataPtr a = sim.adapter.allocate(1 * MiB);
  c10::DataPtr b = sim.adapter.allocate(1 * MiB);
  REQUIRE(pool.fake->owns(a.get()));
  REQUIRE(pool.fake->owns(b.get()));
  REQUIRE(pool.fake->raw_alloc_calls == 1);  // one 2 MiB segment holds both
  REQUIRE(pool.fake->in_use == 2 * MiB);
  REQUIRE(sim.backend.ledger(0).reserves == 0);
  REQUIRE(sim.reserved() == 2 * MiB);
  REQUIRE(pool_of(sim, a) == PoolId{1, 0});
}

TEST_CASE("requests outside a MemPool with its own allocator come from the device", "[torch][pools][allocator]") {
  SimAdapter sim;
  PoolWithAllocator pool(sim);
  sim.context.stream = 0;
  c10::DataPtr outside = sim.adapter.allocate(1 * MiB);
  REQUIRE_FALSE(pool.fake->owns(outside.get()));
  REQUIRE(pool.fake->raw_alloc_calls == 0);
  REQUIRE(sim.backend.ledger(0).reserves == 1);
}

TEST_CASE("a MemPool's segments go back through its allocator's raw_delete, never to the device",
          "[torch][pools][allocator]") {
  SimAdapter sim;
  PoolWithAllocator pool(sim);
  { c10::DataPtr a = sim.adapter.allocate(30 * MiB); }
  REQUIRE(pool.fake->raw_delete_calls == 0);  // freed into the pool's cache
  pool.destroy();
  REQUIRE(pool.fake->raw_delete_calls == 1);
  REQUIRE(pool.fake->in_use == 0);
  REQUIRE(sim.backend.ledger(0).releases == 0);
  REQUIRE(sim.reserved() == 0);
}

TEST_CASE("a MemPool's allocator is called with the pool's device current", "[torch][pools][allocator]") {
  SimAdapter sim;
  PoolWithAllocator pool(sim, 1);
  { c10::DataPtr a = sim.adapter.allocate(30 * MiB); }
  sim.adapter.endAllocateToPool(1, kPool);
  sim.adapter.releasePool(1, kPool);
  sim.adapter.releasePool(1, kPool);
  sim.context.device = 0;
  empty_cache(sim.adapter, kPool);
  REQUIRE(pool.fake->alloc_devices == std::vector<int>{1});
  REQUIRE(pool.fake->delete_devices == std::vector<int>{1});
  REQUIRE(sim.context.device == 0);  // restored
}

TEST_CASE("a MemPool's allocator's memory counts under gpumem's cap", "[torch][pools][allocator][cap]") {
  SimAdapter sim;
  sim.core_device().set_limit(std::optional<std::size_t>(40 * MiB));
  PoolWithAllocator pool(sim);
  c10::DataPtr pooled = sim.adapter.allocate(30 * MiB);
  sim.context.stream = 0;
  REQUIRE_THROWS_AS(sim.adapter.allocate(12 * MiB), c10::OutOfMemoryError);
  REQUIRE(sim.reserved() == 30 * MiB);
  REQUIRE(pool.fake->in_use == 30 * MiB);
  REQUIRE(sim.backend.ledger(0).peak == 0);
}

TEST_CASE("nullptr from a MemPool's allocator is an OutOfMemoryError, the cap given back", "[torch][pools][allocator][cap]") {
  SimAdapter sim;
  PoolWithAllocator pool(sim);
  pool.fake->capacity = 8 * MiB;
  REQUIRE_THROWS_AS(sim.adapter.allocate(12 * MiB), c10::OutOfMemoryError);
  REQUIRE(sim.reserved() == 0);
  REQUIRE(sim.backend.ledger(0).reserves == 0);
  sim.core_device().check_invariants();
}

TEST_CASE("torch's OutOfMemoryError from a MemPool's allocator counts as a refusal", "[torch][pools][allocator]") {
  SimAdapter sim;
  PoolWithAllocator pool(sim);
  pool.fake->oom_next = 1;
  c10::DataPtr a = sim.adapter.allocate(3 * MiB);  // the 20 MiB segment refused, then a 4 MiB one
  REQUIRE(pool.fake->raw_alloc_calls == 2);
  REQUIRE(sim.reserved() == 4 * MiB);
}

TEST_CASE("a MemPool's allocator that throws passes its error on, the cap rolled back", "[torch][pools][allocator][cap]") {
  SimAdapter sim;
  PoolWithAllocator pool(sim);
  pool.fake->throw_next = 1;
  REQUIRE_THROWS_WITH(sim.adapter.allocate(12 * MiB), Catch::Contains("broke"));
  REQUIRE(sim.reserved() == 0);
  sim.core_device().check_invariants();
  c10::DataPtr a = sim.adapter.allocate(12 * MiB);
  REQUIRE(pool.fake->owns(a.get()));
  REQUIRE(sim.reserved() == 12 * MiB);
}

#if GPUMEM_TORCH_HAS_POOL_ALLOCATOR_SHARED_PTR  // gpumem holds the allocator (a shared_ptr): from 2.11 on
TEST_CASE("a MemPool's allocator is kept alive while its pool holds segments from it", "[torch][pools][allocator]") {
  SimAdapter sim;
  std::weak_ptr<FakePoolAllocator> watch;
  c10::DataPtr live;
  {
    PoolWithAllocator pool(sim);
    watch = pool.fake;
    live = sim.adapter.allocate(12 * MiB);
    pool.destroy();
  }
  REQUIRE_FALSE(watch.expired());  // the MemPool is gone; a tensor of it lives on
  live.clear();
  REQUIRE_FALSE(watch.expired());  // freed into the pool's cache
  empty_cache(sim.adapter, kPool);
  REQUIRE(watch.expired());
  REQUIRE(sim.reserved() == 0);
}
#endif

TEST_CASE("an allocator for a pool that exists already is refused with a clear error", "[torch][pools][allocator]") {
  SimAdapter sim;
  create_or_incref_pool(sim.adapter, 0, kPool);
  auto fake = std::make_shared<FakePoolAllocator>(sim.context);
  REQUIRE_THROWS_WITH(sim.adapter.createOrIncrefPool(0, kPool, pool_allocator_arg(fake)), Catch::Contains("exists already"));
  REQUIRE(sim.adapter.getPoolUseCount(0, kPool) == 1);
}

TEST_CASE("gpumem itself as a MemPool's allocator is the same as none", "[torch][pools][allocator]") {
  SimAdapter sim;
  TorchAllocatorPtr self(&sim.adapter, [](auto*) {});
  sim.adapter.createOrIncrefPool(0, kPool, pool_allocator_arg(self));
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  c10::DataPtr a = sim.adapter.allocate(1 * MiB);
  REQUIRE(sim.backend.ledger(0).reserves == 1);
  REQUIRE(pool_of(sim, a) == PoolId{1, 0});
  sim.adapter.endAllocateToPool(0, kPool);
}
#endif  // GPUMEM_TORCH_HAS_CREATE_OR_INCREF_POOL

// ---- no_split and use_on_oom ----

#if GPUMEM_TORCH_HAS_SET_NO_SPLIT  // setNoSplit: from 2.10 on
TEST_CASE("a no_split MemPool hands out whole blocks", "[torch][pools][no_split]") {
  SimAdapter sim;
  create_or_incref_pool(sim.adapter, 0, kPool);
  sim.adapter.setNoSplit(0, kPool);
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  c10::DataPtr a = sim.adapter.allocate(4096);
  c10::DataPtr b = sim.adapter.allocate(4096);
  sim.adapter.endAllocateToPool(0, kPool);
  int segments = 0;
  for (const SegmentInfo& s : sim.core_device().snapshot()) {
    REQUIRE(s.blocks.size() == 1);
    ++segments;
  }
  REQUIRE(segments == 2);
}
#endif

#if GPUMEM_TORCH_HAS_SET_USE_ON_OOM  // setUseOnOOM: from 2.8 on
TEST_CASE("a use_on_oom MemPool's cached blocks serve a default-pool request at the cap", "[torch][pools][use_on_oom]") {
  SimAdapter sim;
  sim.core_device().set_limit(std::optional<std::size_t>(40 * MiB));
  create_or_incref_pool(sim.adapter, 0, kPool);
  set_use_on_oom(sim.adapter, 0, kPool);
  sim.adapter.beginAllocateToPool(0, kPool, capture_stream_only());
  sim.context.stream = kCaptureStream;
  std::uintptr_t cached = 0;
  {
    c10::DataPtr pooled = sim.adapter.allocate(30 * MiB);
    cached = address_of(pooled);
  }
  sim.adapter.endAllocateToPool(0, kPool);
  c10::DataPtr borrowed = sim.adapter.allocate(30 * MiB);  // 30 + 30 MiB do not fit under 40
  REQUIRE(address_of(borrowed) == cached);
#if GPUMEM_TORCH_HAS_SET_USE_ON_OOM_FLAG  // clearing the option: from 2.11 on
  borrowed.clear();
  sim.adapter.setUseOnOOM(0, kPool, false);
  REQUIRE_THROWS_AS(sim.adapter.allocate(30 * MiB), c10::OutOfMemoryError);
#endif
}
#endif

#if GPUMEM_TORCH_HAS_SET_NO_SPLIT  // setNoSplit: from 2.10 on
TEST_CASE("pool options for a pool that does not exist raise an error", "[torch][pools]") {
  SimAdapter sim;
  REQUIRE_THROWS_WITH(sim.adapter.setNoSplit(0, kPool), Catch::Contains("does not exist"));
}
#endif

#if GPUMEM_TORCH_HAS_CAPTURE_RECORD_STREAM_REUSE  // the setting is newer than 2.6
TEST_CASE("torch's graph_capture_record_stream_reuse setting reaches the pool a capture begins", "[torch][pools]") {
  const bool reuse = GENERATE(false, true);
  set_torch_settings(std::string("graph_capture_record_stream_reuse:") + (reuse ? "True" : "False"));
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, kPool, [](cudaStream_t) { return true; });
  sim.context.stream = 1;
  c10::DataPtr keep = sim.adapter.allocate(4096);
  c10::DataPtr used = sim.adapter.allocate(4096);
  void* freed = used.get();
  sim.adapter.record_stream(used, 2);
  used.clear();
  sim.backend.wait_stream(0, 1, 2);
  c10::DataPtr next = sim.adapter.allocate(4096);
  REQUIRE((next.get() == freed) == reuse);
  sim.adapter.endAllocateToPool(0, kPool);
  set_torch_settings("graph_capture_record_stream_reuse:False");
}
#endif
