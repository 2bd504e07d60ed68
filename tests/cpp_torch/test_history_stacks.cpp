// The stacks the history keeps, by torch's RecordContext level: STATE on live blocks and segments
// (snapshots), ALLOC also on allocation entries, ALL also the freeing stack on free entries.
#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "adapter_fixture.h"
#include "torch_calls.h"

using namespace gpumem;
using namespace gpumem::testing;
using Action = c10::cuda::CUDACachingAllocator::TraceEntry::Action;
using RecordContext = c10::cuda::CUDACachingAllocator::RecordContext;

namespace {

// A stack as the test's recorder makes them: numbered in the order they are gathered.
struct Stack final : c10::GatheredContext {
  explicit Stack(int id) : id(id) {}
  int id;
};

std::atomic<int> gathered{0};
std::shared_ptr<c10::GatheredContext> recorder() { return std::make_shared<Stack>(++gathered); }

// The id of a context, 0 for none.
int id_of(const std::shared_ptr<c10::GatheredContext>& context) {
  return context ? static_cast<const Stack&>(*context).id : 0;
}

void record(TorchAllocator& adapter, RecordContext when) {
  gathered = 0;
  record_history(adapter, true, &recorder, 1000, when, true);
}

const c10::cuda::CUDACachingAllocator::TraceEntry& entry(TorchAllocator& adapter, Action action, int nth = 0) {
  static c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot;
  snapshot = adapter.snapshot_of({0, 0}, true);
  for (const auto& e : snapshot.device_traces.at(0)) {
    if (e.action_ == action && nth-- == 0) return e;
  }
  FAIL("no such entry");
  return snapshot.device_traces.at(0).front();
}

// The stack the snapshot shows for the allocated block at `ptr`, and for its segment.
std::pair<int, int> snapshot_stacks(TorchAllocator& adapter, const void* ptr) {
  const auto addr = reinterpret_cast<std::size_t>(ptr);
  for (const auto& segment : adapter.snapshot_of({0, 0}, false).segments) {
    std::size_t at = segment.address;
    for (const auto& block : segment.blocks) {
      if (at == addr && block.allocated) return {id_of(block.context_when_allocated), id_of(segment.context_when_allocated)};
      at += block.size;
    }
  }
  FAIL("no allocated block there");
  return {0, 0};
}

}  // namespace

TEST_CASE("at STATE snapshots show the stack that allocated each live block and its segment", "[torch][history]") {
  SimAdapter sim;
  record(sim.adapter, RecordContext::STATE);
  c10::DataPtr a = sim.adapter.allocate(12 * MiB);  // stack 1, makes a segment of its own size
  REQUIRE(snapshot_stacks(sim.adapter, a.get()) == std::pair{1, 1});
  REQUIRE(id_of(entry(sim.adapter, Action::ALLOC).context_) == 0);  // entries carry none at STATE
}

TEST_CASE("a segment whose head is split for a request shows no stack, as native", "[torch][history]") {
  // Native keeps a segment's stack on the block heading it, and a block split off the front
  // starts without one; torch's own tests (test_memory_plots_free_stack) rely on it.
  SimAdapter sim;
  record(sim.adapter, RecordContext::STATE);
  c10::DataPtr a = sim.adapter.allocate(1000);  // stack 1, makes the segment and splits its head
  c10::DataPtr b = sim.adapter.allocate(2000);  // stack 2, same segment
  REQUIRE(snapshot_stacks(sim.adapter, a.get()) == std::pair{1, 0});
  REQUIRE(snapshot_stacks(sim.adapter, b.get()) == std::pair{2, 0});
}

TEST_CASE("a freed block's stack is forgotten, and the next block there shows its own", "[torch][history]") {
  SimAdapter sim;
  record(sim.adapter, RecordContext::STATE);
  c10::DataPtr keep = sim.adapter.allocate(1000);
  void* where = nullptr;
  {
    c10::DataPtr a = sim.adapter.allocate(4000);
    where = a.get();
  }
  c10::DataPtr again = sim.adapter.allocate(4000);
  REQUIRE(again.get() == where);
  REQUIRE(snapshot_stacks(sim.adapter, again.get()).first == 3);
}

TEST_CASE("at ALLOC allocation entries carry the allocating stack, and so do the free entries", "[torch][history]") {
  SimAdapter sim;
  record(sim.adapter, RecordContext::ALLOC);
  { c10::DataPtr a = sim.adapter.allocate(1000); }
  REQUIRE(id_of(entry(sim.adapter, Action::SEGMENT_ALLOC).context_) == 1);
  REQUIRE(id_of(entry(sim.adapter, Action::ALLOC).context_) == 1);
  REQUIRE(id_of(entry(sim.adapter, Action::FREE_REQUESTED).context_) == 1);
  REQUIRE(id_of(entry(sim.adapter, Action::FREE_COMPLETED).context_) == 1);
  REQUIRE(gathered == 1);  // no freeing stack is taken below ALL
}

TEST_CASE("at ALL free entries carry the freeing stack", "[torch][history]") {
  SimAdapter sim;
  record(sim.adapter, RecordContext::ALL);
  { c10::DataPtr a = sim.adapter.allocate(1000); }
  REQUIRE(id_of(entry(sim.adapter, Action::ALLOC).context_) == 1);
  REQUIRE(id_of(entry(sim.adapter, Action::FREE_REQUESTED).context_) == 2);
}

TEST_CASE("a segment freed by empty_cache carries empty_cache's stack at ALL and its maker's below", "[torch][history]") {
  const auto when = GENERATE(RecordContext::ALLOC, RecordContext::ALL);
  SimAdapter sim;
  record(sim.adapter, when);
  { c10::DataPtr a = sim.adapter.allocate(12 * MiB); }  // a segment of its own size: its head is not split
  empty_cache(sim.adapter);
  const int expected = when == RecordContext::ALL ? 3 : 1;  // ALL: 1 alloc, 2 free, 3 empty_cache
  REQUIRE(id_of(entry(sim.adapter, Action::SEGMENT_FREE).context_) == expected);
}

TEST_CASE("raw allocations keep their stacks too", "[torch][history]") {
  SimAdapter sim;
  record(sim.adapter, RecordContext::ALLOC);
  void* ptr = sim.adapter.raw_alloc(5000);
  REQUIRE(snapshot_stacks(sim.adapter, ptr).first == 1);
  sim.adapter.raw_delete(ptr);
  REQUIRE(id_of(entry(sim.adapter, Action::FREE_REQUESTED).context_) == 1);
}

TEST_CASE("an out-of-memory entry carries the stack of the request", "[torch][history]") {
  SimAdapter sim;
  sim.core_device().set_limit(std::size_t{64} * MiB);
  record(sim.adapter, RecordContext::ALLOC);
  REQUIRE_THROWS_AS(sim.adapter.allocate(100 * MiB), c10::OutOfMemoryError);
  REQUIRE(id_of(entry(sim.adapter, Action::OOM).context_) == 1);
}

TEST_CASE("turning history off keeps the stacks of live blocks and segments, as native", "[torch][history]") {
  // torch's cudagraph trees record a warm-up run only, then read the stacks of the blocks it left.
  SimAdapter sim;
  record(sim.adapter, RecordContext::STATE);
  c10::DataPtr a = sim.adapter.allocate(12 * MiB);  // stack 1, a segment of its own size
  c10::DataPtr b = sim.adapter.allocate(1000);      // stack 2
  stop_history(sim.adapter);
  REQUIRE(snapshot_stacks(sim.adapter, a.get()) == std::pair{1, 1});
  REQUIRE(snapshot_stacks(sim.adapter, b.get()).first == 2);
  REQUIRE(sim.adapter.snapshot_of({0, 0}, true).device_traces.at(0).empty());  // the entries went
}

TEST_CASE("a kept stack goes with its block: what is allocated there later shows none", "[torch][history]") {
  SimAdapter sim;
  record(sim.adapter, RecordContext::STATE);
  c10::DataPtr keep = sim.adapter.allocate(1000);
  void* where = nullptr;
  {
    c10::DataPtr a = sim.adapter.allocate(4000);
    where = a.get();
    stop_history(sim.adapter);
  }
  c10::DataPtr again = sim.adapter.allocate(4000);
  REQUIRE(again.get() == where);
  REQUIRE(snapshot_stacks(sim.adapter, again.get()).first == 0);
  REQUIRE(snapshot_stacks(sim.adapter, keep.get()).first == 1);
}

TEST_CASE("once the last kept stack is gone the allocation path stops reporting", "[torch][history]") {
  SimAdapter sim;
  record(sim.adapter, RecordContext::STATE);
  std::optional<c10::DataPtr> a(sim.adapter.allocate(12 * MiB));
  stop_history(sim.adapter);
  REQUIRE(History::any_active());  // following a's stacks
  a.reset();
  REQUIRE(History::any_active());  // the segment's stack stays until the segment is given back
  empty_cache(sim.adapter);
  REQUIRE_FALSE(History::any_active());
}

#if GPUMEM_TORCH_HAS_COMPILE_CONTEXT && GPUMEM_TORCH_HAS_USER_METADATA  // user metadata: from 2.10 on; compile contexts are older
TEST_CASE("entries are tagged with the compile region and the user's metadata", "[torch][history]") {
  SimAdapter sim;
  record(sim.adapter, RecordContext::STATE);
  std::string region = "Torch-Compiled Region: 0/0";
  sim.adapter.pushCompileContext(region);
  sim.adapter.setUserMetadata("step 7");
  REQUIRE(sim.adapter.getUserMetadata() == "step 7");
  { c10::DataPtr a = sim.adapter.allocate(1000); }
  sim.adapter.popCompileContext();
  sim.adapter.setUserMetadata("");
  { c10::DataPtr b = sim.adapter.allocate(1000); }
  REQUIRE(entry(sim.adapter, Action::ALLOC, 0).compile_context_ == region);
  REQUIRE(entry(sim.adapter, Action::ALLOC, 0).user_metadata_ == "step 7");
  REQUIRE(entry(sim.adapter, Action::ALLOC, 1).compile_context_ == "N/A");
  REQUIRE(entry(sim.adapter, Action::ALLOC, 1).user_metadata_.empty());
}
#endif

namespace {

std::shared_ptr<c10::GatheredContext> failing_recorder() { throw std::runtime_error("no frames"); }

struct CollectWarnings : c10::WarningHandler {
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

}  // namespace

TEST_CASE("a recorder that throws costs the stack, not the allocation or the free", "[torch][history]") {
  SimAdapter sim;
  CollectWarnings warnings;
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  record_history(sim.adapter, true, &failing_recorder, 100, RecordContext::ALL, true);
  c10::DataPtr a = sim.adapter.allocate(1000);
  a.clear();
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 0);
  REQUIRE(warnings.messages.size() == 2);
  REQUIRE_THAT(warnings.messages[0], Catch::Contains("no frames"));
}

TEST_CASE("a trace tracker that throws leaves the allocator consistent", "[torch][history]") {
  SimAdapter sim;
  CollectWarnings warnings;
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  sim.adapter.attachAllocatorTraceTracker([](const auto&) { throw std::runtime_error("tracker broke"); });
  c10::DataPtr a = sim.adapter.allocate(3 * MiB);  // a new segment: the tracker hears of it first
  REQUIRE(sim.backend.ledger(0).in_use == sim.reserved());
  a.clear();
  empty_cache(sim.adapter);
  REQUIRE(sim.backend.ledger(0).in_use == 0);
  REQUIRE_FALSE(warnings.messages.empty());
  sim.core_device().check_invariants();
}
