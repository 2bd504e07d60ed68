// Growable segments seen through torch: snapshots mark them expandable, the history records the
// pages mapped and unmapped, getExpandableSegmentSizes lists them as native lists its own.
#include <catch2/catch.hpp>

#include <algorithm>
#include <optional>
#include <vector>

#include "adapter_fixture.h"
#include "torch_calls.h"

using namespace gpumem;
using namespace gpumem::testing;
using Action = c10::cuda::CUDACachingAllocator::TraceEntry::Action;
using TraceEntry = c10::cuda::CUDACachingAllocator::TraceEntry;

namespace {

constexpr std::size_t kPage = 2 * MiB;

std::vector<TraceEntry> segment_entries(TorchAllocator& adapter) {
  std::vector<TraceEntry> out;
  const auto snapshot = adapter.snapshot_of({0, 0}, true);
  for (const TraceEntry& entry : snapshot.device_traces.at(0)) {
    if (entry.action_ != Action::ALLOC && entry.action_ != Action::FREE_REQUESTED &&
        entry.action_ != Action::FREE_COMPLETED) {
      out.push_back(entry);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("snapshot marks the segments of a device that maps pages expandable", "[torch][growable]") {
  SimAdapter sim(1 * GiB, 2, kPage);
  c10::DataPtr a = sim.adapter.allocate(8 * MiB);
  const auto segments = sim.adapter.snapshot_of({0, 0}, false).segments;
  REQUIRE_FALSE(segments.empty());
  for (const auto& segment : segments) REQUIRE(segment.is_expandable);
}

TEST_CASE("snapshot marks plain segments not expandable", "[torch][growable]") {
  SimAdapter sim(1 * GiB, 2, kPage);
  sim.core_device().set_growable(false);
  c10::DataPtr a = sim.adapter.allocate(8 * MiB);
  const auto segments = sim.adapter.snapshot_of({0, 0}, false).segments;
  REQUIRE(segments.size() == 1);
  REQUIRE_FALSE(segments[0].is_expandable);
}

TEST_CASE("history records the pages growable segments map and unmap, as torch's expandable segments do",
          "[torch][growable]") {
  SimAdapter sim(1 * GiB, 2, kPage);
  record_history(sim.adapter, true, nullptr, 100, TorchRecordContext::STATE);
  c10::DataPtr a = sim.adapter.allocate(16 * MiB);  // one chunk of the large pool
  const std::uintptr_t address = address_of(a);
  a.clear();
  empty_cache(sim.adapter);
  const std::vector<TraceEntry> entries = segment_entries(sim.adapter);
  REQUIRE(entries.size() == 2);
  REQUIRE(entries[0].action_ == Action::SEGMENT_MAP);
  REQUIRE(entries[0].addr_ == address);
  REQUIRE(entries[0].size_ == 16 * MiB);
  REQUIRE(entries[1].action_ == Action::SEGMENT_UNMAP);
  REQUIRE(entries[1].addr_ == address);
  REQUIRE(entries[1].size_ == 16 * MiB);
}

#if GPUMEM_TORCH_HAS_EXPANDABLE_SEGMENT_SIZES  // getExpandableSegmentSizes: from 2.10 on
TEST_CASE("expandable segment sizes are the mapped bytes per side stream and pool kind", "[torch][growable]") {
  SimAdapter sim(1 * GiB, 2, kPage);
  c10::DataPtr on_default_stream = sim.adapter.allocate(16 * MiB);
  sim.context.stream = 7;
  c10::DataPtr large = sim.adapter.allocate(16 * MiB);  // one chunk of the large pool
  c10::DataPtr small = sim.adapter.allocate(1000);
  const auto sizes = sim.adapter.getExpandableSegmentSizes(0);
  REQUIRE(sizes.size() == 2);
  for (const auto& size : sizes) {
    REQUIRE(size.stream == reinterpret_cast<cudaStream_t>(7));
    REQUIRE(size.total_size == (size.is_small_pool ? kPage : 16 * MiB));
  }
}

TEST_CASE("a device that has made no allocator lists no expandable segments", "[torch][growable]") {
  SimAdapter sim(1 * GiB, 2, kPage);
  REQUIRE(sim.adapter.getExpandableSegmentSizes(1).empty());
  REQUIRE(sim.adapter.core().existing(1) == nullptr);
}
#endif

TEST_CASE("a region paused and resumed through the adapter keeps its contents: its backup reaches the real backend",
          "[torch][growable][pause]") {
  SimAdapter sim(1 * GiB, 1, kPage);
  DeviceAllocator& device = sim.core_device();
  const PoolId region{std::uint64_t{1} << 62, 7};
  device.create_region(region);
  device.begin_allocate_to_pool(region, [](StreamId) { return true; });
  c10::DataPtr weights = sim.adapter.allocate(3 * kPage);
  device.end_allocate_to_pool(region);
  const std::uintptr_t at = address_of(weights) + kPage;
  sim.backend.write(0, at, 42);

  REQUIRE(device.pause(region, true) >= 3 * kPage);
  REQUIRE_FALSE(sim.backend.is_mapped(0, at));
  REQUIRE(sim.backend.ledger(0).backed_up >= 3 * kPage);
  REQUIRE(device.resume(region) >= 3 * kPage);
  REQUIRE(sim.backend.read(0, at) == std::optional<std::uint64_t>(42));
  // The history saw the pages go and come back, as torch's expandable segments report them.
  record_history(sim.adapter, true, nullptr, 100, TorchRecordContext::STATE);
  REQUIRE(device.pause(region, true) > 0);
  REQUIRE(device.resume(region) > 0);
  const std::vector<TraceEntry> entries = segment_entries(sim.adapter);
  REQUIRE(std::count_if(entries.begin(), entries.end(), [](const TraceEntry& e) { return e.action_ == Action::SEGMENT_UNMAP; }) > 0);
  REQUIRE(std::count_if(entries.begin(), entries.end(), [](const TraceEntry& e) { return e.action_ == Action::SEGMENT_MAP; }) > 0);
}
