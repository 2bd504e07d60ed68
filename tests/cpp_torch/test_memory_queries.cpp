// What torch asks about memory: the fraction <-> limit mapping, emptyCache, cacheInfo,
// getMemoryInfo and getBaseAllocation.
#include <catch2/catch.hpp>

#include "adapter_fixture.h"
#include "torch_calls.h"

using namespace gpumem;
using namespace gpumem::testing;

TEST_CASE("setMemoryFraction sets the limit to that share of the device's total", "[torch][fraction]") {
  SimAdapter sim(1 * GiB);
  sim.adapter.setMemoryFraction(0.25, 0);
  REQUIRE(sim.core_device().limit() == 256 * MiB);
}

TEST_CASE("getMemoryFraction is 1 until a fraction is set, as natively", "[torch][fraction]") {
  SimAdapter sim(1 * GiB);
  REQUIRE(sim.adapter.getMemoryFraction(0) == 1.0);
}

TEST_CASE("getMemoryFraction reads back the fraction set, exactly, per device", "[torch][fraction]") {
  SimAdapter sim(1 * GiB);
  for (const double fraction : {1.0, 0.0, 0.3, 0.7071}) {
    sim.adapter.setMemoryFraction(fraction, 0);
    REQUIRE(sim.adapter.getMemoryFraction(0) == fraction);
  }
  REQUIRE(sim.adapter.getMemoryFraction(1) == 1.0);
}

TEST_CASE("a limit set another way leaves the fraction read back as it was", "[torch][fraction]") {
  SimAdapter sim(1 * GiB);
  sim.core_device().set_limit(std::string_view("512MB"));
  REQUIRE(sim.adapter.getMemoryFraction(0) == 1.0);
  sim.adapter.setMemoryFraction(0.25, 0);
  sim.core_device().set_limit(std::string_view("768MB"));
  REQUIRE(sim.adapter.getMemoryFraction(0) == 0.25);
  REQUIRE(sim.core_device().limit() == 768 * MiB);
}

TEST_CASE("a memory fraction outside 0 to 1 is a c10::ValueError and changes nothing", "[torch][fraction]") {
  SimAdapter sim(1 * GiB);
  sim.adapter.setMemoryFraction(0.5, 0);
  REQUIRE_THROWS_AS(sim.adapter.setMemoryFraction(1.5, 0), c10::ValueError);
  REQUIRE_THROWS_WITH(sim.adapter.setMemoryFraction(-0.1, 0), Catch::Contains("gpumem: bad memory fraction"));
  REQUIRE(sim.core_device().limit() == 512 * MiB);
  REQUIRE(sim.adapter.getMemoryFraction(0) == 0.5);
}

TEST_CASE("the limit a fraction sets is enforced", "[torch][fraction]") {
  SimAdapter sim(1 * GiB);
  sim.adapter.setMemoryFraction(0.1, 0);
  REQUIRE_THROWS_AS(sim.adapter.allocate(200 * MiB), c10::OutOfMemoryError);
}

TEST_CASE("lowering the fraction releases cached memory above the new limit", "[torch][fraction]") {
  SimAdapter sim(1 * GiB);
  { c10::DataPtr freed = sim.adapter.allocate(300 * MiB); }
  sim.adapter.setMemoryFraction(0.125, 0);
  REQUIRE(sim.reserved() <= 128 * MiB);
}

TEST_CASE("emptyCache returns every cached segment of every device", "[torch][cache]") {
  SimAdapter sim;
  { c10::DataPtr a = sim.adapter.allocate(8 * MiB); }
  sim.context.device = 1;
  { c10::DataPtr b = sim.adapter.allocate(1000); }
  empty_cache(sim.adapter);
  REQUIRE(sim.reserved(0) == 0);
  REQUIRE(sim.reserved(1) == 0);
  REQUIRE(sim.backend.ledger(0).in_use == 0);
  REQUIRE(sim.backend.ledger(1).in_use == 0);
}

TEST_CASE("emptyCache keeps memory that is in use", "[torch][cache]") {
  SimAdapter sim;
  c10::DataPtr live = sim.adapter.allocate(8 * MiB);
  empty_cache(sim.adapter);
  REQUIRE(sim.reserved() == 20 * MiB);
}

TEST_CASE("cacheInfo reports the largest cached free block", "[torch][cache]") {
  SimAdapter sim;
  { c10::DataPtr a = sim.adapter.allocate(40 * MiB); }
  std::size_t largest = 1;
  sim.adapter.cacheInfo(0, &largest);
  REQUIRE(largest == 40 * MiB);
}

TEST_CASE("cacheInfo's first guess is what the limit still allows", "[torch][cache]") {
  SimAdapter sim(1 * GiB);
  sim.core_device().set_limit(std::string_view("100MB"));
  c10::DataPtr live = sim.adapter.allocate(30 * MiB);
  std::size_t largest = 0;
  sim.adapter.cacheInfo(0, &largest);
  REQUIRE(largest == 70 * MiB);
}

TEST_CASE("getMemoryInfo reports the limit as total and what could still be reserved as free", "[torch][cache]") {
  SimAdapter sim(1 * GiB);
  sim.core_device().set_limit(std::string_view("256MB"));
  c10::DataPtr live = sim.adapter.allocate(100 * MiB);
  { c10::DataPtr cached = sim.adapter.allocate(50 * MiB); }
  const auto [free, total] = memory_info(sim.adapter, 0);
  REQUIRE(total == 256 * MiB);
  REQUIRE(free == 256 * MiB - sim.reserved());  // cached memory is not free, as native counts it
  REQUIRE(sim.reserved() == 150 * MiB);
}

TEST_CASE("uncapped, the capped view is the device's own", "[torch][cache]") {
  SimAdapter sim(1 * GiB);
  c10::DataPtr live = sim.adapter.allocate(100 * MiB);
  const MemInfo device = sim.backend.mem_info(0);
  const auto [free, total] = sim.adapter.capped_view(0, device);
  REQUIRE(free == device.free);
  REQUIRE(total == device.total);
}

TEST_CASE("getMemoryInfo's free is bounded by what the device itself has", "[torch][cache]") {
  SimAdapter sim(1 * GiB);
  CachingAllocator another_process(sim.backend);  // holds device memory outside this allocator
  void* theirs = another_process.raw_alloc(0, 600 * MiB, 0);
  c10::DataPtr live = sim.adapter.allocate(100 * MiB);
  const auto [free, total] = memory_info(sim.adapter, 0);
  REQUIRE(total == 1 * GiB);
  REQUIRE(free == 1 * GiB - 700 * MiB);
  another_process.raw_free(theirs);
}

TEST_CASE("getBaseAllocation gives the segment holding a pointer and its size", "[torch][cache]") {
  SimAdapter sim;
  c10::DataPtr first = sim.adapter.allocate(1000);
  c10::DataPtr second = sim.adapter.allocate(1000);
  std::size_t size = 0;
  void* base = sim.adapter.getBaseAllocation(second.get(), &size);
  REQUIRE(base == first.get());
  REQUIRE(size == 2 * MiB);
}

TEST_CASE("getBaseAllocation of memory gpumem did not hand out is a c10 error", "[torch][cache]") {
  SimAdapter sim;
  int other = 0;
  std::size_t size = 0;
  REQUIRE_THROWS_WITH(sim.adapter.getBaseAllocation(&other, &size), Catch::Contains("not in memory gpumem handed out"));
}

TEST_CASE("under a limit on the whole process the adapter measures what is outside, and free leaves it out",
          "[torch][cache][scope]") {
  SimAdapter sim(1 * GiB);
  sim.backend.set_use_outside(0, 64 * MiB);
  sim.core_device().set_limit(std::string_view("256MB"));
  sim.core_device().set_scope(LimitScope::kProcess);
  c10::DataPtr live = sim.adapter.allocate(100 * MiB);
  REQUIRE(sim.core_device().cap().outside() == 64 * MiB);  // through the adapter's backend
  REQUIRE(sim.core_device().outside_source() == OutsideSource::kProcessAccounting);
  const auto [free, total] = memory_info(sim.adapter, 0);
  REQUIRE(total == 256 * MiB);
  REQUIRE(free == 256 * MiB - sim.reserved() - 64 * MiB);
  REQUIRE_THROWS_AS(sim.adapter.allocate(120 * MiB), c10::OutOfMemoryError);  // 100 + 120 + 64 > 256
}

TEST_CASE("the adapter's backend passes on what it does not record: the driver's list of processes reaches the core",
          "[torch][backend]") {
  SimAdapter sim(1 * GiB, 1, 2 * MiB);
  sim.backend.set_processes(0, {{4242, 300 * MiB}, {7, 1 * MiB}});
  sim.backend.set_process_accounting(true);
  Backend& seen = sim.adapter.core().backend();  // the tracing backend over the simulated device
  REQUIRE(&seen != static_cast<Backend*>(&sim.backend));
  const std::vector<ProcessUse> listed = seen.processes_on(0);
  REQUIRE(listed.size() == 2);
  REQUIRE(listed[0].pid == 4242);
  REQUIRE(listed[0].bytes == 300 * MiB);
  REQUIRE(seen.process_used(0) == sim.backend.process_used(0));
  REQUIRE(seen.total_memory(0) == 1 * GiB);
  REQUIRE(seen.page_size(0) == 2 * MiB);
}
