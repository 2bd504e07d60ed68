// snapshot() in torch's form, and the allocation history behind _record_memory_history.
#include <catch2/catch.hpp>

#include <vector>

#include "adapter_fixture.h"
#include "torch_calls.h"

using namespace gpumem;
using namespace gpumem::testing;
using Action = c10::cuda::CUDACachingAllocator::TraceEntry::Action;
using RecordContext = c10::cuda::CUDACachingAllocator::RecordContext;

namespace {

c10::cuda::CUDACachingAllocator::SegmentInfo only_segment(const TorchAllocator::SnapshotInfo& info) {
  REQUIRE(info.segments.size() == 1);
  return info.segments[0];
}

std::vector<Action> actions(TorchAllocator& adapter, int device = 0) {
  std::vector<Action> out;
  const auto snapshot = adapter.snapshot_of({0, 0}, true);
  for (const auto& entry : snapshot.device_traces.at(device)) out.push_back(entry.action_);
  return out;
}

void record_history(TorchAllocator& adapter, std::size_t max_entries) {
  testing::record_history(adapter, true, nullptr, max_entries, RecordContext::STATE);
}

#if GPUMEM_TORCH_HAS_SKIP_ACTIONS
void record_history(TorchAllocator& adapter, std::size_t max_entries, const std::vector<std::string>& skip) {
  testing::record_history(adapter, true, nullptr, max_entries, RecordContext::STATE, false, skip);
}
#endif

}  // namespace

TEST_CASE("snapshot describes each segment as torch does", "[torch][snapshot]") {
  SimAdapter sim;
  sim.context.stream = 3;
  c10::DataPtr a = sim.adapter.allocate(1000);
  const auto segment = only_segment(sim.adapter.snapshot_of({0, 0}, false));
  REQUIRE(segment.device == 0);
  REQUIRE(segment.address == address_of(a));
  REQUIRE(segment.total_size == 2 * MiB);
  REQUIRE(segment.allocated_size == 1024);
  REQUIRE(segment.active_size == 1024);
  REQUIRE(segment.requested_size == 1000);
  REQUIRE(segment.stream == reinterpret_cast<cudaStream_t>(3));
  REQUIRE_FALSE(segment.is_large);
  REQUIRE(segment.owner_private_pool_id == c10::cuda::MempoolId_t{0, 0});
}

TEST_CASE("snapshot block states are torch's allocated and pending free and inactive", "[torch][snapshot]") {
  SimAdapter sim;
  c10::DataPtr kept = sim.adapter.allocate(1000);
  c10::DataPtr pending = sim.adapter.allocate(1000);
  sim.adapter.record_stream(pending, 9);
  pending.clear();
  const auto blocks = only_segment(sim.adapter.snapshot_of({0, 0}, false)).blocks;
  REQUIRE(blocks.size() == 3);
  REQUIRE((blocks[0].allocated && blocks[0].active));
  REQUIRE((!blocks[1].allocated && blocks[1].active));
  REQUIRE((!blocks[2].allocated && !blocks[2].active));
  REQUIRE(blocks[0].requested_size == 1000);
  REQUIRE(blocks[2].size == 2 * MiB - 2048);
}

TEST_CASE("snapshot of a private pool lists that pool's segments only", "[torch][snapshot]") {
  SimAdapter sim;
  c10::DataPtr outside = sim.adapter.allocate(1000);
  sim.adapter.beginAllocateToPool(0, {3, 0}, [](cudaStream_t) { return true; });
  c10::DataPtr inside = sim.adapter.allocate(25 * MiB);
  sim.adapter.endAllocateToPool(0, {3, 0});
  REQUIRE(sim.adapter.snapshot_of({0, 0}, false).segments.size() == 2);
  const auto segment = only_segment(sim.adapter.snapshot_of({3, 0}, false));
  REQUIRE(segment.address == address_of(inside));
  REQUIRE(segment.is_large);
  REQUIRE(segment.owner_private_pool_id == c10::cuda::MempoolId_t{3, 0});
}

TEST_CASE("snapshot has one trace list per device", "[torch][snapshot]") {
  SimAdapter sim;
  REQUIRE(sim.adapter.snapshot_of({0, 0}, true).device_traces.size() == 2);
  REQUIRE(sim.adapter.snapshot_of({0, 0}, false).device_traces.size() == 2);
}

TEST_CASE("history is off until recordHistory turns it on", "[torch][history]") {
  SimAdapter sim;
  REQUIRE_FALSE(sim.adapter.isHistoryEnabled());
  { c10::DataPtr a = sim.adapter.allocate(1000); }
  REQUIRE(actions(sim.adapter).empty());
  record_history(sim.adapter, 100);
  REQUIRE(sim.adapter.isHistoryEnabled());
}

TEST_CASE("history records segment_alloc then alloc then free_requested then free_completed", "[torch][history]") {
  SimAdapter sim;
  record_history(sim.adapter, 100);
  sim.context.stream = 4;
  std::uintptr_t addr = 0;
  {
    c10::DataPtr a = sim.adapter.allocate(1000);
    addr = address_of(a);
  }
  REQUIRE(actions(sim.adapter) ==
          std::vector<Action>{Action::SEGMENT_ALLOC, Action::ALLOC, Action::FREE_REQUESTED, Action::FREE_COMPLETED});
  const auto alloc = sim.adapter.snapshot_of({0, 0}, true).device_traces[0].at(1);
  REQUIRE(alloc.addr_ == addr);
  REQUIRE(alloc.size_ == 1000);
  REQUIRE(alloc.stream_ == reinterpret_cast<cudaStream_t>(4));
  REQUIRE(alloc.time_.t_ > 0);
}

TEST_CASE("history records segment_free when the cache is emptied", "[torch][history]") {
  SimAdapter sim;
  { c10::DataPtr a = sim.adapter.allocate(1000); }
  record_history(sim.adapter, 100);
  empty_cache(sim.adapter);
  REQUIRE(actions(sim.adapter) == std::vector<Action>{Action::SEGMENT_FREE});
}

TEST_CASE("history records raw allocations and frees", "[torch][history]") {
  SimAdapter sim;
  record_history(sim.adapter, 100);
  sim.adapter.raw_delete(sim.adapter.raw_alloc(1000));
  REQUIRE(actions(sim.adapter) ==
          std::vector<Action>{Action::SEGMENT_ALLOC, Action::ALLOC, Action::FREE_REQUESTED, Action::FREE_COMPLETED});
}

TEST_CASE("history records an out-of-memory with the device's free bytes as its address", "[torch][history]") {
  SimAdapter sim(1 * GiB);
  sim.core_device().set_limit(std::string_view("64MB"));
  record_history(sim.adapter, 100);
  REQUIRE_THROWS_AS(sim.adapter.allocate(100 * MiB), c10::OutOfMemoryError);
  const auto traces = sim.adapter.snapshot_of({0, 0}, true).device_traces[0];
  REQUIRE(traces.size() == 1);
  REQUIRE(traces[0].action_ == Action::OOM);
  REQUIRE(traces[0].addr_ == 1 * GiB);
  REQUIRE(traces[0].size_ == 100 * MiB);
}

TEST_CASE("history keeps the most recent entries up to its bound", "[torch][history]") {
  SimAdapter sim;
  { c10::DataPtr warm = sim.adapter.allocate(1000); }
  record_history(sim.adapter, 3);
  std::vector<std::uintptr_t> addresses;
  std::vector<c10::DataPtr> live;
  for (int i = 0; i < 5; ++i) {
    live.push_back(sim.adapter.allocate(1000));
    addresses.push_back(address_of(live.back()));
  }
  const auto traces = sim.adapter.snapshot_of({0, 0}, true).device_traces[0];
  REQUIRE(traces.size() == 3);
  for (int i = 0; i < 3; ++i) REQUIRE(traces[i].addr_ == addresses[i + 2]);
}

#if GPUMEM_TORCH_HAS_SKIP_ACTIONS  // recordHistory's skip_actions: from 2.11 on
TEST_CASE("history skips the actions it is told to skip", "[torch][history]") {
  SimAdapter sim;
  record_history(sim.adapter, 100, {"alloc", "segment_alloc"});
  { c10::DataPtr a = sim.adapter.allocate(1000); }
  REQUIRE(actions(sim.adapter) == std::vector<Action>{Action::FREE_REQUESTED, Action::FREE_COMPLETED});
}
#endif

TEST_CASE("turning history off drops what it recorded, as native does", "[torch][history]") {
  SimAdapter sim;
  record_history(sim.adapter, 100);
  { c10::DataPtr a = sim.adapter.allocate(1000); }
  REQUIRE(actions(sim.adapter).size() == 4);
  stop_history(sim.adapter);
  REQUIRE_FALSE(sim.adapter.isHistoryEnabled());
  { c10::DataPtr b = sim.adapter.allocate(1000); }
  REQUIRE(actions(sim.adapter).empty());
}

#if GPUMEM_TORCH_HAS_CLEAR_HISTORY  // recordHistory's clear_history: from 2.8 on
TEST_CASE("clearing history drops the entries while recording goes on", "[torch][history]") {
  SimAdapter sim;
  record_history(sim.adapter, 100);
  { c10::DataPtr a = sim.adapter.allocate(1000); }
  testing::record_history(sim.adapter, true, nullptr, 100, RecordContext::STATE, true);
  REQUIRE(actions(sim.adapter).empty());
  { c10::DataPtr b = sim.adapter.allocate(1000); }  // from the cache: no segment_alloc
  REQUIRE(actions(sim.adapter) == std::vector<Action>{Action::ALLOC, Action::FREE_REQUESTED, Action::FREE_COMPLETED});
}
#endif

#if GPUMEM_TORCH_HAS_SKIP_ACTIONS  // recordHistory's skip_actions: from 2.11 on
TEST_CASE("an unknown action in skip_actions is an error that changes nothing", "[torch][history]") {
  SimAdapter sim;
  REQUIRE_THROWS_WITH(record_history(sim.adapter, 100, {"alloc", "allocate"}),
                      Catch::Contains("'allocate'") && Catch::Contains("segment_unmap"));
  REQUIRE_FALSE(sim.adapter.isHistoryEnabled());
}
#endif

TEST_CASE("an attached trace tracker sees allocations without history on", "[torch][history]") {
  SimAdapter sim;
  std::vector<Action> seen;
  sim.adapter.attachAllocatorTraceTracker([&](const auto& entry) { seen.push_back(entry.action_); });
  { c10::DataPtr a = sim.adapter.allocate(1000); }
  REQUIRE(seen == std::vector<Action>{Action::SEGMENT_ALLOC, Action::ALLOC, Action::FREE_REQUESTED, Action::FREE_COMPLETED});
  REQUIRE(actions(sim.adapter).empty());
}

// ---- the requested size of a free block (Note [the requested size of a free block]) ----

namespace {

// The requested size the snapshot shows for the free block at `addr`, -1 if none starts there.
long long free_block_requested(TorchAllocator& adapter, std::uintptr_t addr) {
  for (const auto& segment : adapter.snapshot_of({0, 0}, false).segments) {
    std::uintptr_t at = segment.address;
    for (const auto& block : segment.blocks) {
      if (at == addr && !block.active) return static_cast<long long>(block.requested_size);
      at += block.size;
    }
  }
  return -1;
}

}  // namespace

TEST_CASE("while recording, a free block shows the size of the block freed into it last, as native",
          "[torch][snapshot][history]") {
  SimAdapter sim;
  record_history(sim.adapter, 100);
  c10::DataPtr first = sim.adapter.allocate(1000);
  c10::DataPtr second = sim.adapter.allocate(3000);
  const std::uintptr_t start = address_of(first);
  second.clear();
  REQUIRE(free_block_requested(sim.adapter, start + 1024) == 3000);
  first.clear();  // merges with the free block after it
  REQUIRE(only_segment(sim.adapter.snapshot_of({0, 0}, false)).blocks.size() == 1);
  REQUIRE(free_block_requested(sim.adapter, start) == 1000);
}

TEST_CASE("memory handed out again no longer shows what was freed there", "[torch][snapshot][history]") {
  SimAdapter sim;
  record_history(sim.adapter, 100);
  std::uintptr_t start = 0;
  {
    c10::DataPtr freed = sim.adapter.allocate(1000);
    start = address_of(freed);
  }
  c10::DataPtr again = sim.adapter.allocate(4096);
  REQUIRE(address_of(again) == start);
  REQUIRE(free_block_requested(sim.adapter, start + 4096) == 0);
}

TEST_CASE("a segment given back to the device takes what was freed in it along", "[torch][snapshot][history]") {
  SimAdapter sim;
  record_history(sim.adapter, 100);
  std::uintptr_t start = 0;
  {
    c10::DataPtr head = sim.adapter.allocate(1000);
    c10::DataPtr next = sim.adapter.allocate(1000);
    start = address_of(head);
  }
  empty_cache(sim.adapter);
  c10::DataPtr fresh = sim.adapter.allocate(512);
  REQUIRE(address_of(fresh) == start);  // the simulated device hands the same range out again
  REQUIRE(free_block_requested(sim.adapter, start + 512) == 0);
}

TEST_CASE("without recording a free block shows no requested size", "[torch][snapshot][history]") {
  SimAdapter sim;
  record_history(sim.adapter, 100);
  std::uintptr_t start = 0;
  {
    c10::DataPtr freed = sim.adapter.allocate(1000);
    start = address_of(freed);
  }
  stop_history(sim.adapter);
  REQUIRE(free_block_requested(sim.adapter, start) == 0);
}

TEST_CASE("the history notes frees while recording: the latest in a range, dropped by range, per device",
          "[torch][history]") {
  History history(2);
  history.note_free(0, 0x1000, 50);  // not recording: not noted
  REQUIRE(history.last_freed_within(0, 0x1000, 0x400) == 0);
  history.configure(true, nullptr, 10, RecordContext::STATE, false, {});
  history.note_free(0, 0x1400, 200);
  history.note_free(0, 0x1000, 100);
  history.note_free(1, 0x1000, 300);
  REQUIRE(history.last_freed_within(0, 0x1000, 0x800) == 100);
  REQUIRE(history.last_freed_within(0, 0x1400, 0x400) == 200);
  REQUIRE(history.last_freed_within(1, 0x1000, 0x800) == 300);
  history.drop_frees(0, 0x1000, 0x400);
  REQUIRE(history.last_freed_within(0, 0x1000, 0x800) == 200);
  REQUIRE(history.last_freed_within(1, 0x1000, 0x800) == 300);
}
