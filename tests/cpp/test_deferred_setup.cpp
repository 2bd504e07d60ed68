// CachingAllocator before its devices are used: nothing asks the backend anything, and a deferred
// setup runs once, before the first device is made or configured (core/caching_allocator.h).
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/caching_allocator.h"
#include "helpers.h"

using namespace gpumem_test;

TEST_CASE("a CachingAllocator asks its backend nothing until a device is needed", "[core][setup]") {
  CountingBackend backend(1 * GiB, 2);
  CachingAllocator core(backend);
  int runs = 0;
  core.defer_setup([&](CachingAllocator&) { ++runs; });
  REQUIRE(backend.asked() == 0);
  REQUIRE(runs == 0);
  REQUIRE(core.device_count() == 2);
  REQUIRE(backend.device_counts == 1);
  REQUIRE(core.device_count() == 2);
  REQUIRE(backend.device_counts == 1);  // counted once
  REQUIRE(runs == 0);            // counting is not using a device
}

TEST_CASE("a device's total comes from total_memory, not from a call that needs its context", "[core][setup]") {
  CountingBackend backend(1 * GiB, 1);
  CachingAllocator core(backend);
  REQUIRE(core.device(0).device_total() == 1 * GiB);
  REQUIRE(backend.totals == 1);
  REQUIRE(backend.infos == 0);
}

TEST_CASE("the deferred setup runs once, before the first device is made", "[core][setup]") {
  SimBackend backend(1 * GiB, 2);
  CachingAllocator core(backend);
  std::vector<bool> made_when_run;
  core.defer_setup([&](CachingAllocator& c) {
    made_when_run.push_back(c.existing(0) != nullptr);
    AllocatorConfig config;
    config.limit = 256 * MiB;
    c.configure(0, config);  // configuring inside the setup does not run it again
  });
  REQUIRE(core.device(0).limit() == 256 * MiB);
  core.device(1);
  core.run_setup();
  REQUIRE(made_when_run == std::vector<bool>{false});
}

TEST_CASE("configuring a device runs the deferred setup first, so the later call wins", "[core][setup]") {
  SimBackend backend(1 * GiB, 1);
  CachingAllocator core(backend);
  core.defer_setup([](CachingAllocator& c) {
    AllocatorConfig config;
    config.limit = 512 * MiB;
    c.configure(0, config);
  });
  AllocatorConfig mine;
  mine.limit = 128 * MiB;
  core.configure(0, mine);
  REQUIRE(core.device(0).limit() == 128 * MiB);
}

TEST_CASE("a setup that throws makes no device and throws again at the next use", "[core][setup]") {
  SimBackend backend(1 * GiB, 1);
  CachingAllocator core(backend);
  int runs = 0;
  core.defer_setup([&](CachingAllocator&) {
    ++runs;
    throw std::invalid_argument("bad setting");
  });
  REQUIRE_THROWS_WITH(core.device(0), "bad setting");
  REQUIRE(core.existing(0) == nullptr);
  REQUIRE_THROWS_WITH(core.malloc(0, 1 * MiB, 0), "bad setting");
  REQUIRE(core.existing(0) == nullptr);
  REQUIRE(runs == 2);
  REQUIRE(backend.ledger(0).reserves == 0);
}

TEST_CASE("a setup replaced before it ran is not run", "[core][setup]") {
  SimBackend backend(1 * GiB, 1);
  CachingAllocator core(backend);
  int first = 0, second = 0;
  core.defer_setup([&](CachingAllocator&) { ++first; });
  core.defer_setup([&](CachingAllocator&) { ++second; });
  core.device(0);
  REQUIRE(first == 0);
  REQUIRE(second == 1);
}

TEST_CASE("threads that first use devices at once all wait for the one setup", "[core][setup][threads]") {
  SimBackend backend(1 * GiB, 4);
  CachingAllocator core(backend);
  std::atomic<int> runs{0};
  core.defer_setup([&](CachingAllocator& c) {
    ++runs;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int d = 0; d < c.device_count(); ++d) {
      AllocatorConfig config;
      config.limit = 64 * MiB;
      c.configure(d, config);
    }
  });
  std::vector<std::thread> threads;
  std::vector<std::size_t> limits(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] { limits[t] = core.device(t % 4).limit(); });
  }
  for (std::thread& t : threads) t.join();
  REQUIRE(runs == 1);
  for (std::size_t limit : limits) REQUIRE(limit == 64 * MiB);
}
