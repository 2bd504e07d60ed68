// A limit on the whole process (Note [a limit on the whole process], core/limits.cpp):
// what the driver counts for the process, the allocator's memory and what it does not hold, stays
// under the limit. The simulated device plays the driver: set_use_outside is a library's buffers
// (and other processes' memory), and its ledger is what the allocator holds, so ledger.in_use +
// the process's outside bytes is the figure nvidia-smi would show.
#include <atomic>
#include <thread>
#include <vector>

#include "helpers.h"

using namespace gpumem_test;

namespace {

constexpr std::size_t kLimit = 4 * GiB;

// Allocates `size` blocks until the allocator refuses; returns the blocks and the refusal.
template <class S>
std::pair<std::vector<Block*>, Oom> fill(S& sim, std::size_t size) {
  std::vector<Block*> blocks;
  Oom oom = oom_from([&] {
    for (;;) blocks.push_back(sim.malloc(size));
  });
  return {blocks, oom};
}

}  // namespace

TEST_CASE("under the process scope the memory outside the allocator counts against the limit",
          "[scope][cap]") {
  for (const std::size_t page : {std::size_t{0}, kSimPage}) {
    Sim sim(kLimit, kDeviceBytes, 0.0, page);
    sim.backend.set_use_outside(0, 1 * GiB + 300 * MiB);
    sim.alloc.set_scope(LimitScope::kProcess);
    REQUIRE(sim.alloc.outside_source() == OutsideSource::kNone);  // nothing held yet: the first growth measures

    auto [blocks, oom] = fill(sim, 100 * MiB);
    REQUIRE(sim.alloc.cap().outside() == 1 * GiB + 300 * MiB);
    REQUIRE(sim.alloc.outside_source() == OutsideSource::kProcessAccounting);
    const std::size_t process = sim.ledger().in_use + 1 * GiB + 300 * MiB;
    REQUIRE(process <= kLimit);
    REQUIRE(process > kLimit - 100 * MiB);  // the cap binds at the limit, not earlier
    REQUIRE(oom.info.kind == OomKind::kOverLimit);
    REQUIRE(oom.info.process_scope);
    REQUIRE(oom.info.outside == 1 * GiB + 300 * MiB);
    REQUIRE(oom.message.find("on the whole process, of which 1.29 GiB is held outside") != std::string::npos);
    for (Block* b : blocks) sim.free(b);
  }
}

TEST_CASE("under the allocator scope the same device lets the allocator reserve the whole limit", "[scope][cap]") {
  Sim sim(kLimit);
  sim.backend.set_use_outside(0, 1 * GiB);
  auto [blocks, oom] = fill(sim, 100 * MiB);
  REQUIRE(sim.ledger().in_use > kLimit - 100 * MiB);
  REQUIRE(sim.alloc.cap().outside() == 0);
  REQUIRE(sim.alloc.outside_source() == OutsideSource::kNone);
  REQUIRE_FALSE(oom.info.process_scope);
  REQUIRE(oom.message.find("whole process") == std::string::npos);
}

TEST_CASE("memory a library takes later is counted at the next growth, and the cache gives way to it",
          "[scope][cap]") {
  for (const std::size_t page : {std::size_t{0}, kSimPage}) {
    Sim sim(kLimit, kDeviceBytes, 0.0, page);
    sim.alloc.set_scope(LimitScope::kProcess);
    std::vector<Block*> blocks;
    for (int i = 0; i < 30; ++i) blocks.push_back(sim.malloc(100 * MiB));
    for (int i = 10; i < 30; ++i) sim.free(blocks[i]);  // 2000 MiB cached
    blocks.resize(10);
    REQUIRE(sim.ledger().in_use >= 3000 * MiB);

    // NCCL's buffers, say, appear outside the allocator: 2 GiB.
    sim.backend.set_use_outside(0, 2 * GiB);
    // A request the cache cannot serve (another stream's) measures them and releases cached memory
    // down to the budget.
    sim.malloc(600 * MiB, kStream1);
    REQUIRE(sim.alloc.cap().outside() == 2 * GiB);
    REQUIRE(sim.ledger().in_use + 2 * GiB <= kLimit);
    REQUIRE(sim.stats().num_cache_releases >= 1);
  }
}

TEST_CASE("lowering the limit under the process scope releases down to the limit less what is outside",
          "[scope][cap]") {
  Sim sim(kLimit);
  sim.backend.set_use_outside(0, 1 * GiB);
  sim.alloc.set_scope(LimitScope::kProcess);
  std::vector<Block*> blocks;
  for (int i = 0; i < 20; ++i) blocks.push_back(sim.malloc(100 * MiB));
  for (Block* b : blocks) sim.free(b);
  REQUIRE(sim.ledger().in_use == 2000 * MiB);
  sim.alloc.set_limit(std::optional<std::size_t>(2 * GiB));
  REQUIRE(sim.ledger().in_use <= 1 * GiB);
}

TEST_CASE("without the driver's figure for the process, outside is the device's used memory at first use",
          "[scope][cap]") {
  Sim sim(kLimit);
  sim.backend.set_process_accounting(false);
  sim.backend.set_use_outside(0, 500 * MiB, 700 * MiB);  // the process's 500 MiB and another's 700
  sim.alloc.set_scope(LimitScope::kProcess);
  Block* b = sim.malloc(100 * MiB);
  // Other processes are counted as this one's: the figure errs on the side of the cap.
  REQUIRE(sim.alloc.cap().outside() == 1200 * MiB);
  REQUIRE(sim.alloc.outside_source() == OutsideSource::kDeviceAtFirst);
  // Measured once: what changes later is not seen.
  sim.backend.set_use_outside(0, 900 * MiB, 700 * MiB);
  sim.malloc(200 * MiB);
  REQUIRE(sim.alloc.cap().outside() == 1200 * MiB);
  sim.free(b);
}

TEST_CASE("the process scope waits for the first growth to measure, and the allocator scope forgets it",
          "[scope]") {
  AllocatorConfig config = config_with(kLimit);
  config.scope = LimitScope::kProcess;
  SimBackend backend(kDeviceBytes);
  backend.set_use_outside(0, 1 * GiB);
  DeviceAllocator alloc(backend, 0, config);
  REQUIRE(alloc.scope() == LimitScope::kProcess);
  REQUIRE(alloc.outside_source() == OutsideSource::kNone);  // made without asking the device
  Block* b = alloc.malloc(10 * MiB, kStream0);
  REQUIRE(alloc.cap().outside() == 1 * GiB);
  alloc.set_scope(LimitScope::kAllocator);
  REQUIRE(alloc.cap().outside() == 0);
  REQUIRE(alloc.outside_source() == OutsideSource::kNone);
  alloc.free(b);
}

TEST_CASE("pressure under the process scope is measured on reserved plus what is outside", "[scope][pressure]") {
  Sim sim(kLimit);
  sim.backend.set_use_outside(0, 1536 * MiB);
  sim.alloc.set_scope(LimitScope::kProcess);
  Block* first = sim.malloc(2 * MiB);  // the first growth measures what is outside
  sim.alloc.watch_pressure(0, 0.5);  // at 2 GiB of 4
  std::uint64_t crossings = 0;
  auto count = [&] {
    crossings = 0;
    sim.alloc.cap().pressure().for_each([&](const PressureCount& c) { crossings += c.crossings; });
    return crossings;
  };
  REQUIRE(count() == 0);
  sim.malloc(600 * MiB);  // 1.5 GiB outside + 602 MiB > 2 GiB; reserved alone is far below
  REQUIRE(count() == 1);
  sim.free(first);
}

TEST_CASE("a figure below what the allocator holds is not taken for the process's", "[scope]") {
  // As a pid of another pid namespace would give: another process's smaller figure.
  class OtherPid : public SimBackend {
   public:
    using SimBackend::SimBackend;
    std::optional<std::size_t> process_used(int) override { return 1 * MiB; }
  };
  OtherPid backend(kDeviceBytes);
  DeviceAllocator alloc(backend, 0, config_with(kLimit));
  alloc.set_scope(LimitScope::kProcess);
  Block* b = alloc.malloc(100 * MiB, kStream0);
  Block* c = alloc.malloc(100 * MiB, kStream1);  // measured with 100 MiB held: 1 MiB is not ours
  REQUIRE(alloc.outside_source() == OutsideSource::kDeviceAtFirst);
  alloc.free(b);
  alloc.free(c);
}

TEST_CASE("setting the process scope on a device that holds nothing asks the device nothing", "[scope]") {
  CountingBackend backend(kDeviceBytes);
  DeviceAllocator alloc(backend, 0, config_with(kLimit));
  alloc.set_scope(LimitScope::kProcess);
  alloc.set_limit(std::optional<std::size_t>(2 * GiB));
  REQUIRE(backend.process_uses + backend.infos == 0);  // on CUDA, asking would make the device's context
  Block* b = alloc.malloc(10 * MiB, kStream0);
  REQUIRE(backend.process_uses + backend.infos == 1);
  alloc.free(b);
}

TEST_CASE("threads growing under the process scope never take the process past the limit", "[scope][threads]") {
  Sim sim(kLimit);
  sim.backend.set_use_outside(0, 1 * GiB);
  sim.alloc.set_scope(LimitScope::kProcess);
  std::atomic<bool> over{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<Block*> mine;
      for (int i = 0; i < 200; ++i) {
        try {
          mine.push_back(sim.alloc.malloc((1 + (i * 7 + t) % 13) * 20 * MiB, static_cast<StreamId>(t)));
        } catch (const OutOfMemoryError&) {
          for (Block* b : mine) sim.alloc.free(b);
          mine.clear();
        }
        if (sim.backend.ledger(0).in_use + 1 * GiB > kLimit) over = true;
      }
      for (Block* b : mine) sim.alloc.free(b);
    });
  }
  for (auto& th : threads) th.join();
  REQUIRE_FALSE(over);
  REQUIRE(sim.ledger().peak + 1 * GiB <= kLimit);
}
