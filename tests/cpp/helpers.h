// Shared by the allocator tests: one simulated device with its allocator, sizes in readable units,
// and a way to catch an OutOfMemoryError and look at it.
//
// The SimBackend's ledger is the independent witness: it counts what the device handed out without
// asking the allocator, so a test that checks the cap reads the ledger, not the allocator's stats.
#pragma once

#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "backends/sim_backend.h"
#include "core/device_allocator.h"
#include "core/errors.h"
#include "core/sizing.h"
#include "core/stats.h"

namespace gpumem_test {

using namespace gpumem;

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t kDeviceBytes = 8 * GiB;  // the simulated device, unless a test says otherwise

constexpr StreamId kStream0 = 0;
constexpr StreamId kStream1 = 1;
constexpr StreamId kStream2 = 2;
constexpr StreamId kStream3 = 3;

inline AllocatorConfig config_with(std::optional<std::size_t> limit, double release_threshold = 0.0) {
  AllocatorConfig config;
  config.limit = limit;
  config.release_threshold = release_threshold;
  return config;
}

// A simulated device that counts what the core asks of it, as a driver would see it: the queries
// (device_count, total_memory, mem_info, page_size, process_used). On CUDA some of these need the
// device's context, so tests hold the core to asking only when it must.
class CountingBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  mutable std::atomic<int> device_counts{0};
  std::atomic<int> totals{0}, infos{0}, page_sizes{0}, process_uses{0};

  int device_count() const override {
    ++device_counts;
    return SimBackend::device_count();
  }
  std::size_t total_memory(int device) override {
    ++totals;
    return SimBackend::total_memory(device);
  }
  MemInfo mem_info(int device) override {
    ++infos;
    return SimBackend::mem_info(device);
  }
  std::size_t page_size(int device) override {
    ++page_sizes;
    return SimBackend::page_size(device);
  }
  std::optional<std::size_t> process_used(int device) override {
    ++process_uses;
    return SimBackend::process_used(device);
  }
  int asked() const { return device_counts + totals + infos + page_sizes + process_uses; }
};

constexpr std::size_t kSimPage = 2 * MiB;  // the page of a simulated device with virtual memory

// One simulated device and the allocator under test. malloc and free check the invariants after
// every call, so a test that only mutates still verifies the block lists and the statistics.
// With `page` > 0 the device has virtual memory of that granularity, and the allocator uses
// growable segments unless `growable` is false.
struct Sim {
  SimBackend backend;
  DeviceAllocator alloc;

  explicit Sim(std::optional<std::size_t> limit = std::nullopt, std::size_t capacity = kDeviceBytes,
               double release_threshold = 0.0, std::size_t page = 0, bool growable = true,
               std::size_t large_chunk = AllocatorConfig{}.large_chunk)
      : backend(capacity), alloc(with_pages(backend, page), 0, grow_config(limit, release_threshold, growable, large_chunk)) {}

  static SimBackend& with_pages(SimBackend& backend, std::size_t page) {
    if (page > 0) backend.enable_virtual_memory(page);
    return backend;
  }
  static AllocatorConfig grow_config(std::optional<std::size_t> limit, double release_threshold, bool growable,
                                     std::size_t large_chunk) {
    AllocatorConfig config = config_with(limit, release_threshold);
    config.growable = growable;
    config.large_chunk = large_chunk;
    return config;
  }
  Block* malloc(std::size_t size, StreamId stream = kStream0) {
    Block* block = alloc.malloc(size, stream);
    alloc.check_invariants();
    return block;
  }
  void free(Block* block) {
    alloc.free(block);
    alloc.check_invariants();
  }
  SimBackend::Ledger ledger() const { return backend.ledger(0); }
  DeviceStats stats() const { return alloc.stats(); }
  std::vector<SegmentInfo> snapshot() const { return alloc.snapshot(); }
  bool mapped(std::uintptr_t addr) const { return backend.is_mapped(0, addr); }

  // The snapshot entry of the segment that holds `block`.
  SegmentInfo segment_of(const Block* block) const {
    for (const SegmentInfo& s : alloc.snapshot()) {
      if (block->addr >= s.addr && block->addr < s.addr + s.size) return s;
    }
    FAIL("no segment holds the block at " << block->addr);
    return {};
  }
  bool has_segment_at(std::uintptr_t addr) const {
    for (const SegmentInfo& s : alloc.snapshot()) {
      if (s.addr == addr) return true;
    }
    return false;
  }
};

// The same device with virtual memory (pages of kSimPage): growable segments by default.
struct VmSim : Sim {
  explicit VmSim(std::optional<std::size_t> limit = std::nullopt, bool growable = true, double release_threshold = 0.0,
                 std::size_t large_chunk = AllocatorConfig{}.large_chunk)
      : Sim(limit, kDeviceBytes, release_threshold, kSimPage, growable, large_chunk) {}
};

// The error a call threw; fails the test if it threw none.
struct Oom {
  OomInfo info;
  std::string message;
};

template <class Call>
Oom oom_from(Call&& call) {
  try {
    call();
  } catch (const OutOfMemoryError& e) {
    return Oom{e.info(), e.what()};
  }
  FAIL("expected an OutOfMemoryError");
  return {};
}

// Bytes in segments that hold at least one block that is not free.
inline std::size_t bytes_of_segments_in_use(const std::vector<SegmentInfo>& snapshot) {
  std::size_t bytes = 0;
  for (const SegmentInfo& s : snapshot) {
    for (const BlockInfo& b : s.blocks) {
      if (b.state != BlockInfo::kFree) {
        bytes += s.size;
        break;
      }
    }
  }
  return bytes;
}

inline std::size_t reserved_in_snapshot(const std::vector<SegmentInfo>& snapshot) {
  std::size_t bytes = 0;
  for (const SegmentInfo& s : snapshot) bytes += s.size;
  return bytes;
}

// The sequence of Note [reserved above a lowered limit], for a plain or a growable simulated
// device (any fixture with malloc, free, alloc and ledger): 8 x 100 MiB under 1 GB, the limit
// lowered to 100 MB while all are alive, then every one freed, each free giving memory back, and
// 50 MiB allocated under the lowered limit.
template <class S>
void free_everything_above_a_lowered_limit(S& sim) {
  std::vector<Block*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(sim.malloc(100 * MiB));
  const std::size_t limit = 100 * 1000 * 1000;
  sim.alloc.set_limit(std::optional<std::size_t>(limit));
  REQUIRE(sim.ledger().in_use == 800 * MiB);  // all alive: nothing to release yet

  std::size_t before = sim.ledger().in_use;
  for (Block* b : blocks) {
    sim.free(b);
    REQUIRE(sim.ledger().in_use < before);  // each free gave its memory back
    before = sim.ledger().in_use;
  }
  REQUIRE(sim.ledger().in_use <= limit);
  REQUIRE(sim.alloc.reserved() == sim.ledger().in_use);
  sim.malloc(50 * MiB);
  REQUIRE(sim.ledger().in_use <= limit);
}

}  // namespace gpumem_test

namespace Catch {
template <>
struct StringMaker<gpumem::PoolId> {
  static std::string convert(const gpumem::PoolId& id) {
    return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
  }
};
template <>
struct StringMaker<gpumem::OomKind> {
  static std::string convert(gpumem::OomKind kind) { return gpumem::oom_kind_name(kind); }
};
}  // namespace Catch
