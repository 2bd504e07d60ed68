// torch.profiler(profile_memory=True): the profiler hears of every block handed out and freed,
// with the device's allocated and reserved totals, and of out-of-memory errors.
#include <catch2/catch.hpp>

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <memory>
#include <vector>

#include "adapter_fixture.h"
#include "torch_calls.h"

using namespace gpumem;
using namespace gpumem::testing;

namespace {

struct Report {
  void* ptr;
  std::int64_t size;
  std::size_t allocated;
  std::size_t reserved;
};

// What a profiler with memory profiling on receives.
struct FakeProfiler final : c10::MemoryReportingInfoBase {
  void reportMemoryUsage(void* ptr, std::int64_t size, std::size_t allocated, std::size_t reserved,
                         c10::Device device) override {
    REQUIRE(device.type() == c10::DeviceType::CUDA);
    reports.push_back({ptr, size, allocated, reserved});
  }
  void reportOutOfMemory(std::int64_t size, std::size_t, std::size_t, c10::Device) override { ooms.push_back(size); }
  bool memoryProfilingEnabled() const override { return true; }
  std::vector<Report> reports;
  std::vector<std::int64_t> ooms;
};

}  // namespace

TEST_CASE("the memory profiler hears of each block handed out and freed with the totals after it",
          "[torch][profiler]") {
  SimAdapter sim;
  auto profiler = std::make_shared<FakeProfiler>();
  c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, profiler);
  c10::DataPtr a = sim.adapter.allocate(1000);
  void* where = a.get();
  a.clear();
  REQUIRE(profiler->reports.size() == 2);
  REQUIRE(profiler->reports[0].ptr == where);
  REQUIRE(profiler->reports[0].size == 1024);
  REQUIRE(profiler->reports[0].allocated == 1024);
  REQUIRE(profiler->reports[0].reserved == sim.reserved());
  REQUIRE(profiler->reports[1].size == -1024);
  REQUIRE(profiler->reports[1].allocated == 0);
}

TEST_CASE("the memory profiler hears of raw allocations as of tensors, recording or not", "[torch][profiler]") {
  SimAdapter sim;
  const bool recording = GENERATE(false, true);
  if (recording) {
    record_history(sim.adapter, true, nullptr, 100, TorchRecordContext::STATE);
  }
  auto profiler = std::make_shared<FakeProfiler>();
  c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, profiler);
  void* raw = sim.adapter.raw_alloc(3000);
  sim.adapter.raw_delete(raw);
  REQUIRE(profiler->reports.size() == 2);
  REQUIRE(profiler->reports[0].ptr == raw);
  REQUIRE(profiler->reports[0].size == 3072);
  REQUIRE(profiler->reports[0].allocated == 3072);
  REQUIRE(profiler->reports[1].ptr == raw);
  REQUIRE(profiler->reports[1].size == -3072);
  REQUIRE(profiler->reports[1].allocated == 0);
}

TEST_CASE("the memory profiler hears of private-pool frees by address too", "[torch][profiler]") {
  SimAdapter sim;
  sim.adapter.beginAllocateToPool(0, {3, 0}, [](cudaStream_t) { return true; });
  auto profiler = std::make_shared<FakeProfiler>();
  c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, profiler);
  sim.adapter.allocate(4 * MiB).clear();
  sim.adapter.endAllocateToPool(0, {3, 0});
  REQUIRE(profiler->reports.size() == 2);
  REQUIRE(profiler->reports[1].size == -static_cast<std::int64_t>(4 * MiB));
}

TEST_CASE("the memory profiler hears of an out-of-memory error", "[torch][profiler]") {
  SimAdapter sim;
  sim.core_device().set_limit(std::size_t{64} * MiB);
  auto profiler = std::make_shared<FakeProfiler>();
  c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, profiler);
  REQUIRE_THROWS_AS(sim.adapter.allocate(100 * MiB), c10::OutOfMemoryError);
  REQUIRE(profiler->ooms == std::vector<std::int64_t>{100 * MiB});
}
