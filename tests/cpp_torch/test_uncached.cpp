// torch.cuda.caching_allocator_enable(False): nothing is cached, the statistics count the memory
// (each allocation a segment holding one allocated block: Note [caching off in the statistics],
// core/uncached.h, where native counts nothing), and the cap still holds.
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>

#include <vector>

#include "adapter_fixture.h"

using namespace gpumem;
using namespace gpumem::testing;

namespace {

std::size_t in_use(SimAdapter& sim) { return sim.backend.ledger(0).in_use; }
std::int64_t allocated(SimAdapter& sim) { return sim.core_device().stats().allocated_bytes[kAll].current; }

}  // namespace

TEST_CASE("with caching off a freed tensor goes back to the device at once", "[torch][uncached]") {
  SimAdapter sim;
  sim.adapter.enable(false);
  REQUIRE_FALSE(sim.adapter.isEnabled());
  c10::DataPtr ptr = sim.adapter.allocate(3 * MiB + 1);
  REQUIRE(ptr.get() != nullptr);
  REQUIRE(ptr.get_deleter() == sim.adapter.raw_deleter());
  REQUIRE(in_use(sim) == 3 * MiB + 512);
  REQUIRE(sim.reserved() == 3 * MiB + 512);
  REQUIRE(allocated(sim) == 3 * MiB + 512);
  REQUIRE(sim.core_device().stats().reserved_bytes[kAll].current == 3 * MiB + 512);
  REQUIRE(sim.core_device().snapshot().empty());
  ptr.clear();
  REQUIRE(in_use(sim) == 0);
  REQUIRE(sim.reserved() == 0);
  REQUIRE(allocated(sim) == 0);
  REQUIRE(sim.core_device().stats().reserved_bytes[kAll].current == 0);
  REQUIRE(sim.core_device().stats().reserved_bytes[kAll].peak == 3 * MiB + 512);
  sim.core_device().check_invariants();
}

TEST_CASE("with caching off the cap still holds", "[torch][uncached]") {
  SimAdapter sim;
  sim.core_device().set_limit(10 * MiB);
  sim.adapter.enable(false);
  c10::DataPtr first = sim.adapter.allocate(6 * MiB);
  REQUIRE_THROWS_AS(sim.adapter.allocate(6 * MiB), c10::OutOfMemoryError);
  REQUIRE(in_use(sim) == 6 * MiB);
  first.clear();
  c10::DataPtr again = sim.adapter.allocate(6 * MiB);
  REQUIRE(in_use(sim) == 6 * MiB);
  sim.core_device().check_invariants();
}

TEST_CASE("with caching off cached memory is given back to make room under the cap", "[torch][uncached]") {
  SimAdapter sim;
  sim.core_device().set_limit(10 * MiB);
  sim.adapter.allocate(8 * MiB).clear();  // cached
  REQUIRE(sim.reserved() == 8 * MiB);
  sim.adapter.enable(false);
  c10::DataPtr ptr = sim.adapter.allocate(6 * MiB);
  REQUIRE(sim.reserved() == 6 * MiB);
  REQUIRE(in_use(sim) == 6 * MiB);
  sim.core_device().check_invariants();
}

TEST_CASE("cached memory counts against the cap beside uncached memory", "[torch][uncached]") {
  SimAdapter sim;
  sim.core_device().set_limit(10 * MiB);
  sim.adapter.enable(false);
  c10::DataPtr uncached = sim.adapter.allocate(6 * MiB);
  sim.adapter.enable(true);
  REQUIRE_THROWS_AS(sim.adapter.allocate(6 * MiB), c10::OutOfMemoryError);
  c10::DataPtr cached = sim.adapter.allocate(4 * MiB);
  REQUIRE(in_use(sim) <= 10 * MiB);
  sim.core_device().check_invariants();
}

TEST_CASE("raw_alloc counts in the statistics with caching off as with caching on", "[torch][uncached]") {
  SimAdapter sim;
  sim.adapter.enable(false);
  void* ptr = sim.adapter.raw_alloc(1 * MiB);
  REQUIRE(sim.core_device().stats().requested_bytes[kAll].allocated == 1 * MiB);
  REQUIRE(sim.core_device().stats().num_device_alloc == 1);
  REQUIRE(in_use(sim) == 1 * MiB);
  sim.adapter.raw_delete(ptr);
  REQUIRE(in_use(sim) == 0);
  REQUIRE(sim.core_device().stats().num_device_free == 1);
  sim.adapter.enable(true);
  ptr = sim.adapter.raw_alloc(1 * MiB);
  REQUIRE(sim.core_device().stats().requested_bytes[kAll].allocated == 2 * MiB);
  sim.adapter.raw_delete(ptr);
}

TEST_CASE("a tensor made while caching was on returns to the cache after caching is turned off", "[torch][uncached]") {
  SimAdapter sim;
  c10::DataPtr ptr = sim.adapter.allocate(4 * MiB);
  sim.adapter.enable(false);
  ptr.clear();
  REQUIRE(allocated(sim) == 0);
  REQUIRE(sim.reserved() > 0);  // the segment stays cached
  sim.core_device().check_invariants();
}

TEST_CASE("record_stream on memory handed out with caching off is accepted", "[torch][uncached]") {
  SimAdapter sim;
  sim.adapter.enable(false);
  c10::DataPtr ptr = sim.adapter.allocate(1 * MiB);
  REQUIRE_NOTHROW(sim.adapter.record_stream(ptr, 5));
  ptr.clear();
  REQUIRE(in_use(sim) == 0);
}
