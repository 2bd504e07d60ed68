// torch's DeviceStats, as the adapter reports them, against gpumem's own statistics.
#include <catch2/catch.hpp>

#include <vector>

#include "adapter_fixture.h"
#include "torch/stats_mapping.h"

using namespace gpumem;
using namespace gpumem::testing;

namespace {

// Allocations in both pools, on two streams, some freed: every array and counter moves.
std::vector<c10::DataPtr> busy_workload(SimAdapter& sim) {
  std::vector<c10::DataPtr> live;
  for (std::size_t size : {100 * KiB, 700 * KiB, 3 * MiB, 12 * MiB, 30 * MiB, 1000 * std::size_t{1}}) {
    live.push_back(sim.adapter.allocate(size));
    sim.context.stream = sim.context.stream == 0 ? 5 : 0;
  }
  live.erase(live.begin() + 1);
  live.erase(live.begin() + 2);
  sim.core_device().set_limit(std::string_view("40MB"));  // releases cached segments
  return live;
}

template <class TorchStat>
void require_same(const TorchStat& torch_stat, const Stat& stat) {
  REQUIRE(torch_stat.current == stat.current);
  REQUIRE(torch_stat.peak == stat.peak);
  REQUIRE(torch_stat.allocated == stat.allocated);
  REQUIRE(torch_stat.freed == stat.freed);
}

template <class TorchArray>
void require_same_array(const TorchArray& torch_array, const StatArray& array) {
  for (int t = 0; t < kNumStatTypes; ++t) require_same(torch_array[t], array[t]);
}

}  // namespace

TEST_CASE("getDeviceStats equals gpumem's statistics array by array", "[torch][stats]") {
  SimAdapter sim;
  const auto live = busy_workload(sim);
  const DeviceStats ours = sim.core_device().stats();
  const auto theirs = sim.adapter.getDeviceStats(0);
  REQUIRE(ours.allocation[kAll].current == 4);
#define GPUMEM_REQUIRE_SAME(name, help) require_same_array(theirs.name, ours.name);
  GPUMEM_STAT_ARRAYS(GPUMEM_REQUIRE_SAME)
#undef GPUMEM_REQUIRE_SAME
}

TEST_CASE("getDeviceStats carries the counters torch has", "[torch][stats]") {
  SimAdapter sim;
  const auto live = busy_workload(sim);
  REQUIRE_THROWS(sim.adapter.allocate(500 * MiB));
  const DeviceStats ours = sim.core_device().stats();
  const auto theirs = sim.adapter.getDeviceStats(0);
  REQUIRE(ours.num_device_alloc > 0);
  REQUIRE(ours.num_device_free > 0);
  REQUIRE(theirs.num_alloc_retries == ours.num_alloc_retries);
  REQUIRE(theirs.num_ooms == 1);
  REQUIRE(theirs.num_sync_all_streams == ours.num_sync_all_streams);
  REQUIRE(theirs.num_device_alloc == ours.num_device_alloc);
  REQUIRE(theirs.num_device_free == ours.num_device_free);
}

TEST_CASE("getDeviceStats of a device with nothing allocated is all zero and creates nothing", "[torch][stats]") {
  SimAdapter sim;
  const auto stats = sim.adapter.getDeviceStats(1);
  REQUIRE(stats.allocated_bytes[0].current == 0);
  REQUIRE(stats.num_device_alloc == 0);
  REQUIRE(sim.adapter.core().existing(1) == nullptr);
}

TEST_CASE("getDeviceStats of a device the backend does not have is a c10::ValueError", "[torch][stats]") {
  SimAdapter sim;
  REQUIRE_THROWS_AS(sim.adapter.getDeviceStats(7), c10::ValueError);
}

TEST_CASE("resetPeakStats brings peaks down to current", "[torch][stats]") {
  SimAdapter sim;
  { c10::DataPtr big = sim.adapter.allocate(50 * MiB); }
  c10::DataPtr small = sim.adapter.allocate(1 * MiB);
  sim.adapter.resetPeakStats(0);
  const auto stats = sim.adapter.getDeviceStats(0);
  REQUIRE(stats.allocated_bytes[0].peak == stats.allocated_bytes[0].current);
  REQUIRE(stats.allocated_bytes[0].peak == 1 * MiB);
}

TEST_CASE("resetAccumulatedStats zeroes what accumulates and keeps what is current", "[torch][stats]") {
  SimAdapter sim;
  { c10::DataPtr freed = sim.adapter.allocate(5 * MiB); }
  c10::DataPtr live = sim.adapter.allocate(3 * MiB);
  sim.adapter.resetAccumulatedStats(0);
  const auto stats = sim.adapter.getDeviceStats(0);
  REQUIRE(stats.allocated_bytes[0].allocated == 0);
  REQUIRE(stats.allocated_bytes[0].freed == 0);
  REQUIRE(stats.num_device_alloc == 0);
  REQUIRE(stats.allocated_bytes[0].current == 3 * MiB);
}
