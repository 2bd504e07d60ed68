// cudagraph-tree checkpoints: getCheckpointState, then setCheckpointPoolState puts the pool back.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "adapter_fixture.h"

using namespace gpumem;
using namespace gpumem::testing;

namespace {

constexpr c10::cuda::MempoolId_t kPool{7, 0};
constexpr PoolId kCorePool{7, 0};

// A pool held as cudagraph trees hold theirs, every request of this thread routed to it.
struct TreePool {
  explicit TreePool(SimAdapter& sim) : sim(sim) {
    sim.adapter.beginAllocateToPool(0, kPool, [](cudaStream_t) { return true; });
  }
  ~TreePool() { sim.adapter.endAllocateToPool(0, kPool); }
  SimAdapter& sim;
};

// (address, size, allocated) of every block of the pool, in address order, leaving out segments
// that are one free block (a restore leaves segments made after the checkpoint that way).
std::vector<std::tuple<std::uintptr_t, std::size_t, bool>> pool_layout(SimAdapter& sim) {
  std::vector<std::tuple<std::uintptr_t, std::size_t, bool>> out;
  for (const SegmentInfo& s : sim.core_device().snapshot()) {
    if (!(s.pool == kCorePool) || (s.blocks.size() == 1 && s.blocks[0].state == BlockInfo::kFree)) continue;
    for (const BlockInfo& b : s.blocks) out.emplace_back(b.addr, b.size, b.state == BlockInfo::kAllocated);
  }
  return out;
}

std::set<void*> addresses(const std::vector<c10::DataPtr>& ptrs) {
  std::set<void*> out;
  for (const auto& p : ptrs) out.insert(p.get());
  return out;
}

// What torch does with the answer: the old DataPtrs of freed blocks lose their deleter.
void forget_freed(std::vector<c10::DataPtr>& live, const std::vector<void*>& freed) {
  for (auto& p : live) {
    if (std::find(freed.begin(), freed.end(), p.get()) != freed.end()) p.release_context();
  }
  live.clear();
}

}  // namespace

TEST_CASE("a checkpoint restores the pool's allocated blocks at their addresses", "[torch][checkpoint]") {
  SimAdapter sim;
  std::vector<c10::DataPtr> live;
  std::shared_ptr<TorchAllocator::AllocatorState> state;
  std::vector<std::tuple<std::uintptr_t, std::size_t, bool>> saved;
  {
    TreePool pool(sim);
    live.push_back(sim.adapter.allocate(1 * MiB));
    live.push_back(sim.adapter.allocate(300 * KiB));
    live.push_back(sim.adapter.allocate(5 * MiB));
    state = sim.adapter.getCheckpointState(0, kPool);
    saved = pool_layout(sim);
    const std::set<void*> at_checkpoint = addresses(live);
    live.erase(live.begin());
    live.push_back(sim.adapter.allocate(2 * MiB));
    live.push_back(sim.adapter.allocate(40 * MiB));

    const auto delta = sim.adapter.setCheckpointPoolState(0, state);
    forget_freed(live, delta.ptrs_freed);
    REQUIRE(delta.ptrs_freed.size() == 4);
    REQUIRE(addresses(delta.dataptrs_allocd) == at_checkpoint);
    REQUIRE(pool_layout(sim) == saved);
  }
  sim.core_device().check_invariants();
}

TEST_CASE("the DataPtrs a restore hands back free their blocks", "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  live.push_back(sim.adapter.allocate(3 * MiB));
  const auto state = sim.adapter.getCheckpointState(0, kPool);
  auto delta = sim.adapter.setCheckpointPoolState(0, state);
  forget_freed(live, delta.ptrs_freed);
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 3 * MiB);
  delta.dataptrs_allocd.clear();
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 0);
  sim.core_device().check_invariants();
}

TEST_CASE("a block handed back by a restore can be freed by address once its DataPtr lets go", "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  live.push_back(sim.adapter.allocate(3 * MiB));
  auto delta = sim.adapter.setCheckpointPoolState(0, sim.adapter.getCheckpointState(0, kPool));
  forget_freed(live, delta.ptrs_freed);
  void* ptr = delta.dataptrs_allocd.at(0).get();
  delta.dataptrs_allocd.at(0).release_context();
  sim.adapter.raw_delete(ptr);
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 0);
}

TEST_CASE("segments made after the checkpoint are left free by a restore", "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  live.push_back(sim.adapter.allocate(100 * KiB));
  const auto state = sim.adapter.getCheckpointState(0, kPool);
  live.push_back(sim.adapter.allocate(2 * MiB));
  live.push_back(sim.adapter.allocate(64 * MiB));
  const auto delta = sim.adapter.setCheckpointPoolState(0, state);
  forget_freed(live, delta.ptrs_freed);
  REQUIRE(delta.dataptrs_allocd.size() == 1);
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 100 * KiB);
  sim.core_device().check_invariants();
}

TEST_CASE("a restore is refused and changes nothing while a pool block is used by another stream", "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  live.push_back(sim.adapter.allocate(3 * MiB));
  const auto state = sim.adapter.getCheckpointState(0, kPool);
  sim.adapter.record_stream(live[0], 9);
  REQUIRE_THROWS_WITH(sim.adapter.setCheckpointPoolState(0, state), Catch::Contains("another stream"));
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 3 * MiB);
}

TEST_CASE("a restore of a released pool is refused", "[torch][checkpoint]") {
  SimAdapter sim;
  std::shared_ptr<TorchAllocator::AllocatorState> state;
  {
    TreePool pool(sim);
    state = sim.adapter.getCheckpointState(0, kPool);
  }
  sim.adapter.releasePool(0, kPool);
  REQUIRE_THROWS_WITH(sim.adapter.setCheckpointPoolState(0, state), Catch::Contains("released"));
}

TEST_CASE("random allocations in the pool are restored to any earlier checkpoint", "[torch][checkpoint]") {
  const auto seed = GENERATE(1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u);
  std::mt19937 rng(seed);
  SimAdapter sim(4 * GiB);
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  auto random_size = [&] { return static_cast<std::size_t>(std::pow(2.0, std::uniform_real_distribution<>(6, 25)(rng))); };
  auto churn = [&](int steps) {
    for (int i = 0; i < steps; ++i) {
      sim.context.stream = std::uniform_int_distribution<>(0, 3)(rng) == 0 ? 11 : 0;
      if (!live.empty() && std::uniform_int_distribution<>(0, 2)(rng) == 0) {
        live.erase(live.begin() + std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng));
      } else {
        live.push_back(sim.adapter.allocate(random_size()));
      }
    }
  };
  for (int round = 0; round < 5; ++round) {
    churn(60);
    const auto state = sim.adapter.getCheckpointState(0, kPool);
    const auto saved = pool_layout(sim);
    const std::set<void*> at_checkpoint = addresses(live);
    churn(60);
    auto delta = sim.adapter.setCheckpointPoolState(0, state);
    forget_freed(live, delta.ptrs_freed);
    REQUIRE(pool_layout(sim) == saved);
    REQUIRE(addresses(delta.dataptrs_allocd) == at_checkpoint);
    sim.core_device().check_invariants();
    live = std::move(delta.dataptrs_allocd);
  }
}

// ---- as cudagraph trees use it: tensors made before the restore keep their DataPtrs ----

namespace {

// Collects the warnings torch code raises while it lives.
struct CollectedWarnings : c10::WarningHandler {
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

// What torch's binding does with the DataPtrs of a restore when no storage takes them: the block
// stays allocated with no owner, for a later raw_delete.
std::vector<void*> orphan(std::vector<c10::DataPtr>& handed_back) {
  std::vector<void*> out;
  for (auto& p : handed_back) {
    out.push_back(p.get());
    p.release_context();
  }
  handed_back.clear();
  return out;
}

std::size_t allocated(SimAdapter& sim) { return sim.core_device().stats().allocated_bytes[kAll].current; }

}  // namespace

TEST_CASE("tensors alive across a restore free the blocks that stand at their addresses", "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  for (std::size_t size : {512 * KiB, 512 * KiB, 512 * KiB, 300 * KiB}) live.push_back(sim.adapter.allocate(size));
  const auto saved = pool_layout(sim);
  auto delta = sim.adapter.setCheckpointPoolState(0, sim.adapter.getCheckpointState(0, kPool));
  REQUIRE(delta.ptrs_freed.size() == 4);
  REQUIRE(addresses(delta.dataptrs_allocd) == addresses(live));
  orphan(delta.dataptrs_allocd);
  REQUIRE(pool_layout(sim) == saved);
  live.clear();  // the old DataPtrs' deleters run now
  REQUIRE(allocated(sim) == 0);
  sim.core_device().check_invariants();
}

TEST_CASE("a block alive in the middle of a segment is restored and freed through its old tensor",
          "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  for (int i = 0; i < 5; ++i) live.push_back(sim.adapter.allocate(256 * KiB));
  // Keep the middle ones, contiguous, as the graph's outputs.
  live.erase(live.begin());
  live.pop_back();
  const auto saved = pool_layout(sim);
  const auto state = sim.adapter.getCheckpointState(0, kPool);
  auto delta = sim.adapter.setCheckpointPoolState(0, state);
  REQUIRE(addresses(delta.dataptrs_allocd) == addresses(live));
  orphan(delta.dataptrs_allocd);
  REQUIRE(pool_layout(sim) == saved);
  REQUIRE(allocated(sim) == 3 * 256 * KiB);
  live.erase(live.begin() + 1);
  REQUIRE(allocated(sim) == 2 * 256 * KiB);
  live.clear();
  REQUIRE(allocated(sim) == 0);
  sim.core_device().check_invariants();
}

TEST_CASE("a tensor that died after the checkpoint comes back allocated and is freed by address",
          "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  for (int i = 0; i < 3; ++i) live.push_back(sim.adapter.allocate(1 * MiB));
  const auto state = sim.adapter.getCheckpointState(0, kPool);
  void* dead = live[1].get();
  live.erase(live.begin() + 1);
  auto delta = sim.adapter.setCheckpointPoolState(0, state);
  REQUIRE(delta.ptrs_freed.size() == 2);
  REQUIRE(delta.dataptrs_allocd.size() == 3);
  orphan(delta.dataptrs_allocd);
  REQUIRE(allocated(sim) == 3 * MiB);
  sim.adapter.raw_delete(dead);  // cudagraph trees free the outputs that died since the recording
  REQUIRE(allocated(sim) == 2 * MiB);
  live.clear();
  REQUIRE(allocated(sim) == 0);
  sim.core_device().check_invariants();
}

TEST_CASE("a DataPtr handed back to a storage frees its block into the pool", "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  live.push_back(sim.adapter.allocate(2 * MiB));
  const auto state = sim.adapter.getCheckpointState(0, kPool);
  auto delta = sim.adapter.setCheckpointPoolState(0, state);
  // The storage was rebuilt without a deleter; it takes the DataPtr the restore made.
  live[0].release_context();
  c10::DataPtr storage = std::move(delta.dataptrs_allocd.at(0));
  REQUIRE(storage.get_deleter() == sim.adapter.raw_deleter());
  REQUIRE(allocated(sim) == 2 * MiB);
  storage.clear();
  REQUIRE(allocated(sim) == 0);
  sim.core_device().check_invariants();
}

TEST_CASE("a tensor freed twice across a restore is a warning, not a crash", "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  live.push_back(sim.adapter.allocate(1 * MiB));
  const auto state = sim.adapter.getCheckpointState(0, kPool);
  live.push_back(sim.adapter.allocate(1 * MiB));  // made after the checkpoint, not named as stale
  auto delta = sim.adapter.setCheckpointPoolState(0, state);
  REQUIRE(delta.ptrs_freed.size() == 2);
  orphan(delta.dataptrs_allocd);
  CollectedWarnings warnings;
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  live.pop_back();  // its block went with the restore
  REQUIRE(warnings.messages.size() == 1);
  REQUIRE_THAT(warnings.messages[0], Catch::Contains("freed twice"));
  REQUIRE(allocated(sim) == 1 * MiB);
  live.clear();
  REQUIRE(allocated(sim) == 0);
  sim.core_device().check_invariants();
}

TEST_CASE("repeated restores with live tensors keep statistics equal to a recount", "[torch][checkpoint]") {
  SimAdapter sim;
  TreePool pool(sim);
  std::vector<c10::DataPtr> live;
  for (int i = 0; i < 6; ++i) live.push_back(sim.adapter.allocate((i + 1) * 200 * KiB));
  const auto state = sim.adapter.getCheckpointState(0, kPool);
  for (int round = 0; round < 4; ++round) {
    std::vector<c10::DataPtr> extra;
    extra.push_back(sim.adapter.allocate(3 * MiB));
    auto delta = sim.adapter.setCheckpointPoolState(0, state);
    // torch names tensors made after the checkpoint as stale: their deleters are taken away.
    for (auto& p : extra) p.release_context();
    orphan(delta.dataptrs_allocd);
    sim.core_device().check_invariants();  // includes the recount of the statistics
  }
  live.clear();
  REQUIRE(allocated(sim) == 0);
  sim.core_device().check_invariants();
}
