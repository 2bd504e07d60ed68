// Threads on one allocator: the cap holds to the byte whatever the interleaving, blocks handed to
// different threads never overlap, and the statistics add up once the threads are done.
//
// The simulated device's ledger is the witness: its peak counts what the device really handed out,
// without asking the allocator. Catch2 assertions are not thread-safe, so worker threads write what
// they saw wrong into their own log and the test thread asserts after joining them.
//
// GPUMEM_THREAD_OPS sets the operations per test, shared among its threads (default 200,000).
#include <catch2/catch.hpp>

#include "env_settings.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backends/sim_backend.h"
#include "core/caching_allocator.h"
#include "core/device_allocator.h"
#include "core/sizing.h"

namespace {

using gpumem::Block;
using gpumem::BlockInfo;
using gpumem::CachingAllocator;
using gpumem::DeviceAllocator;
using gpumem::OomKind;
using gpumem::OutOfMemoryError;
using gpumem::SegmentInfo;
using gpumem::SimBackend;
using gpumem::StreamId;

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t kCapacity = 1 * GiB;
constexpr std::size_t kTightLimit = 64 * MiB;
constexpr std::size_t kMaxLivePerThread = 24;
constexpr int kThreads = 4;
constexpr StreamId kStreams = 5;
constexpr int kEventQueries = 2;  // events complete on their second query: frees are held a while

std::size_t total_ops() { return gpumem_test::env_number("GPUMEM_THREAD_OPS", 200000); }

// Log-uniform from 512 B to 16 MiB: both pools, and requests that need a segment of their own.
std::size_t draw_size(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(std::log(512.0), std::log(16.0 * MiB));
  return static_cast<std::size_t>(std::exp(u(rng)));
}

// A block one thread holds.
struct Held {
  Block* block;
  int device;
  bool raw;  // from raw_alloc: freed by address
};

// What one worker thread saw. Only its own thread writes it until the thread is joined.
struct ThreadLog {
  std::size_t ooms = 0;
  std::vector<std::string> errors;
  std::map<std::uintptr_t, Held> live;  // by address

  void error(const std::string& what) {
    if (errors.size() < 8) errors.push_back(what);
  }
};

// How a worker reaches the allocator under test.
struct Target {
  std::function<Held(std::size_t size, StreamId stream, std::mt19937_64& rng)> malloc;
  std::function<void(const Held&)> free;
  std::function<void(const Held&, StreamId)> record_stream;
};

// An OOM seen under threads must still be explained by the numbers it reports.
void check_oom(ThreadLog& log, const gpumem::OomInfo& info, std::size_t requested) {
  ++log.ooms;
  if (info.requested != requested) log.error("OOM reports another request size");
  if (info.kind == OomKind::kDeviceFull) log.error("OOM says device full on a device far larger than the limit");
  if (info.kind == OomKind::kOverLimit && info.allocated + gpumem::round_size(requested) <= info.limit) {
    log.error("OOM over the limit although allocated + request fit under it");
  }
}

void check_new_block(ThreadLog& log, const Held& held, std::size_t requested, StreamId stream) {
  const Block& b = *held.block;
  if (!b.allocated || b.size < gpumem::round_size(requested) || b.stream != stream) {
    log.error("malloc returned a block that does not match the request");
  }
  const auto next = log.live.lower_bound(b.addr);
  if (next != log.live.end() && b.addr + b.size > next->first) log.error("new block overlaps a block this thread holds");
  if (next != log.live.begin()) {
    const Block& prev = *std::prev(next)->second.block;
    if (prev.addr + prev.size > b.addr) log.error("new block overlaps a block this thread holds");
  }
}

// Random malloc (on the thread's own stream or another), free and record_stream.
void work(ThreadLog& log, const Target& target, std::uint64_t seed, std::size_t ops, StreamId own_stream) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> percent(0, 99);
  for (std::size_t i = 0; i < ops; ++i) {
    const int roll = percent(rng);
    if (!log.live.empty() && (log.live.size() >= kMaxLivePerThread || roll < 42)) {
      auto it = std::next(log.live.begin(), static_cast<long>(rng() % log.live.size()));
      target.free(it->second);
      log.live.erase(it);
    } else if (roll < 90 || log.live.empty()) {
      const std::size_t size = draw_size(rng);
      const StreamId stream = roll % 4 == 0 ? rng() % kStreams : own_stream;
      try {
        const Held held = target.malloc(size, stream, rng);
        check_new_block(log, held, size, stream);
        log.live.emplace(held.block->addr, held);
      } catch (const OutOfMemoryError& e) {
        check_oom(log, e.info(), size);
      }
    } else {
      auto it = std::next(log.live.begin(), static_cast<long>(rng() % log.live.size()));
      target.record_stream(it->second, rng() % kStreams);
    }
  }
}

// The first thing wrong with a snapshot, or "": segments apart, blocks tiling their segment.
std::string snapshot_problem(const std::vector<SegmentInfo>& segments) {
  std::uintptr_t end = 0;
  for (const SegmentInfo& s : segments) {  // ordered by address
    if (s.addr < end) return "two segments overlap";
    end = s.addr + s.size;
    std::uintptr_t at = s.addr;
    for (const BlockInfo& b : s.blocks) {
      if (b.addr != at) return "blocks of a segment overlap or leave a gap";
      at += b.size;
    }
    if (at != end) return "blocks do not fill their segment";
  }
  return "";
}

// Watches the devices while the workers run: each ledger stays under `ceiling` and every snapshot
// is well formed. `allocator` gives a device's allocator, or nullptr while it does not exist.
using AllocatorOf = std::function<const DeviceAllocator*(int device)>;

class Monitor {
 public:
  Monitor(const SimBackend& backend, AllocatorOf allocator, std::size_t ceiling)
      : thread_([this, &backend, allocator, ceiling] { watch(backend, allocator, ceiling); }) {}
  ~Monitor() { stop(); }

  std::vector<std::string> stop() {
    done_.store(true);
    if (thread_.joinable()) thread_.join();
    return log_.errors;
  }

 private:
  void watch(const SimBackend& backend, const AllocatorOf& allocator, std::size_t ceiling) {
    while (!done_.load()) {
      for (int d = 0; d < backend.device_count(); ++d) {
        if (backend.ledger(d).in_use > ceiling) log_.error("the device held more than the limit");
        const DeviceAllocator* alloc = allocator(d);
        if (!alloc) continue;
        const std::string problem = snapshot_problem(alloc->snapshot());
        if (!problem.empty()) log_.error("snapshot during the run: " + problem);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  std::atomic<bool> done_{false};
  ThreadLog log_;
  std::thread thread_;  // last: starts once the members it uses exist
};

void require_no_errors(const std::vector<ThreadLog>& logs) {
  for (std::size_t t = 0; t < logs.size(); ++t) {
    INFO("thread " << t);
    for (const std::string& e : logs[t].errors) FAIL_CHECK(e);
  }
}

void require_clean(const std::vector<std::string>& errors) {
  for (const std::string& e : errors) FAIL_CHECK(e);
}

std::size_t total_ooms(const std::vector<ThreadLog>& logs) {
  std::size_t n = 0;
  for (const ThreadLog& log : logs) n += log.ooms;
  return n;
}

// After the threads: the snapshot's allocated blocks are exactly those the threads hold.
void require_snapshot_matches(const DeviceAllocator& alloc, const std::vector<ThreadLog>& logs, int device) {
  std::map<std::uintptr_t, std::size_t> held;
  for (const ThreadLog& log : logs) {
    for (const auto& [addr, h] : log.live) {
      if (h.device == device) REQUIRE(held.emplace(addr, h.block->size).second);
    }
  }
  const std::vector<SegmentInfo> segments = alloc.snapshot();
  REQUIRE(snapshot_problem(segments).empty());
  std::map<std::uintptr_t, std::size_t> allocated;
  for (const SegmentInfo& s : segments) {
    for (const BlockInfo& b : s.blocks) {
      if (b.state == BlockInfo::kAllocated) allocated.emplace(b.addr, b.size);
    }
  }
  REQUIRE(allocated == held);
}

std::int64_t bytes_held(const std::vector<ThreadLog>& logs, int device) {
  std::int64_t bytes = 0;
  for (const ThreadLog& log : logs) {
    for (const auto& [addr, h] : log.live) bytes += h.device == device ? static_cast<std::int64_t>(h.block->size) : 0;
  }
  return bytes;
}

void run_workers(std::vector<ThreadLog>& logs, const Target& target, std::uint64_t seed, std::size_t ops_each) {
  std::vector<std::thread> threads;
  for (int t = 0; t < static_cast<int>(logs.size()); ++t) {
    threads.emplace_back([&, t] { work(logs[t], target, seed + t, ops_each, static_cast<StreamId>(t + 1)); });
  }
  for (std::thread& t : threads) t.join();
}

void free_all(std::vector<ThreadLog>& logs, const Target& target) {
  for (ThreadLog& log : logs) {
    for (const auto& [addr, h] : log.live) target.free(h);
    log.live.clear();
  }
}

void require_all_returned(DeviceAllocator& alloc, const SimBackend& backend, int device) {
  alloc.empty_cache();
  alloc.check_invariants();
  REQUIRE(alloc.reserved() == 0);
  const SimBackend::Ledger ledger = backend.ledger(device);
  REQUIRE(ledger.in_use == 0);
  REQUIRE(ledger.address_ranges == 0);
  REQUIRE(ledger.live_events == 0);
  const gpumem::DeviceStats stats = alloc.stats();
  REQUIRE(stats.allocated_bytes[gpumem::kAll].current == 0);
  REQUIRE(stats.active_bytes[gpumem::kAll].current == 0);
  REQUIRE(stats.segment[gpumem::kAll].current == 0);
}

Target device_target(DeviceAllocator& alloc) {
  return Target{
      [&alloc](std::size_t size, StreamId stream, std::mt19937_64&) { return Held{alloc.malloc(size, stream), 0, false}; },
      [&alloc](const Held& h) { alloc.free(h.block); },
      [&alloc](const Held& h, StreamId stream) { alloc.record_stream(h.block, stream); },
  };
}

// Either device, through the Block* API or by address.
Target caching_target(CachingAllocator& alloc) {
  return Target{
      [&alloc](std::size_t size, StreamId stream, std::mt19937_64& rng) {
        const int device = static_cast<int>(rng() % 2);
        if (rng() % 2 == 0) return Held{alloc.malloc(device, size, stream), device, false};
        void* ptr = alloc.raw_alloc(device, size, stream);
        return Held{alloc.find_raw(ptr), device, true};
      },
      [&alloc](const Held& h) {
        if (h.raw) {
          alloc.raw_free(h.block->ptr());
        } else {
          CachingAllocator::free(h.block);
        }
      },
      [](const Held& h, StreamId stream) { h.block->segment->owner->record_stream(h.block, stream); },
  };
}


// Four threads on one device's allocator; `page` > 0 gives the device virtual memory, so new
// memory comes from growable segments.
void run_four_threads_on_one_device(std::size_t page) {
  SimBackend backend(kCapacity);
  backend.auto_complete_after(kEventQueries);
  if (page > 0) backend.enable_virtual_memory(page);
  DeviceAllocator alloc(backend, 0, {kTightLimit, 0.0});
  REQUIRE(alloc.settings().growable == (page > 0));
  const Target target = device_target(alloc);
  std::vector<ThreadLog> logs(kThreads);

  Monitor monitor(backend, [&alloc](int) { return &alloc; }, kTightLimit);
  run_workers(logs, target, 1000, total_ops() / kThreads);
  require_clean(monitor.stop());
  require_no_errors(logs);

  REQUIRE(backend.ledger(0).peak <= kTightLimit);
  REQUIRE(backend.ledger(0).peak > kTightLimit / 2);  // the limit was really pressed against
  alloc.check_invariants();
  require_snapshot_matches(alloc, logs, 0);
  const gpumem::DeviceStats stats = alloc.stats();
  REQUIRE(stats.allocated_bytes[gpumem::kAll].current == bytes_held(logs, 0));
  REQUIRE(stats.num_ooms == static_cast<std::int64_t>(total_ooms(logs)));
  REQUIRE(stats.reserved_bytes[gpumem::kAll].peak <= static_cast<std::int64_t>(kTightLimit));

  free_all(logs, target);
  require_all_returned(alloc, backend, 0);
}

}  // namespace

TEST_CASE("four threads on one device never take it past the limit, nor hand out overlapping blocks", "[threads]") {
  run_four_threads_on_one_device(0);
}

TEST_CASE("four threads on one device with growable segments never take it past the limit", "[threads][growable]") {
  run_four_threads_on_one_device(2 << 20);
}

TEST_CASE("four threads on two devices through the CachingAllocator keep each device under its limit", "[threads]") {
  SimBackend backend(kCapacity, 2);
  backend.auto_complete_after(kEventQueries);
  CachingAllocator alloc(backend, {kTightLimit, 0.0});
  const Target target = caching_target(alloc);
  std::vector<ThreadLog> logs(kThreads);

  // Each device's allocator is created by whichever thread gets there first.
  Monitor monitor(backend, [&alloc](int d) { return alloc.existing(d); }, kTightLimit);
  run_workers(logs, target, 2000, total_ops() / kThreads);
  require_clean(monitor.stop());
  require_no_errors(logs);

  std::size_t ooms = 0;
  for (int d = 0; d < 2; ++d) {
    INFO("device " << d);
    DeviceAllocator* device = alloc.existing(d);
    REQUIRE(device != nullptr);
    REQUIRE(backend.ledger(d).peak <= kTightLimit);
    device->check_invariants();
    require_snapshot_matches(*device, logs, d);
    REQUIRE(device->stats().allocated_bytes[gpumem::kAll].current == bytes_held(logs, d));
    ooms += static_cast<std::size_t>(device->stats().num_ooms);
  }
  REQUIRE(ooms == total_ooms(logs));
  for (const ThreadLog& log : logs) {
    for (const auto& [addr, h] : log.live) {
      if (h.raw) REQUIRE(alloc.find_raw(h.block->ptr()) == h.block);
    }
  }

  free_all(logs, target);
  for (int d = 0; d < 2; ++d) require_all_returned(alloc.device(d), backend, d);
}

TEST_CASE("set_limit raced up and down against allocating threads never lets the device pass the highest limit",
          "[threads]") {
  constexpr std::size_t kLimits[] = {8 * MiB, 16 * MiB, 32 * MiB, 48 * MiB, 64 * MiB};
  constexpr std::size_t kHighest = 64 * MiB;
  constexpr std::size_t kFinal = 16 * MiB;
  constexpr double kThresholds[] = {0.0, 0.5, 1.0};
  constexpr int kWorkers = 3;
  SimBackend backend(kCapacity);
  backend.auto_complete_after(kEventQueries);
  DeviceAllocator alloc(backend, 0, {32 * MiB, 0.0});
  const Target target = device_target(alloc);
  std::vector<ThreadLog> logs(kWorkers);

  Monitor monitor(backend, [&alloc](int) { return &alloc; }, kHighest);
  std::atomic<bool> workers_done{false};
  std::thread setter([&] {
    std::mt19937_64 rng(3000);
    for (int i = 0; !workers_done.load(); ++i) {
      const std::size_t limit = kLimits[rng() % std::size(kLimits)];
      if (i % 2 == 0) {
        alloc.set_limit(std::optional<std::size_t>(limit));
      } else {
        alloc.set_limit(std::to_string(limit));
      }
      if (i % 8 == 0) alloc.set_release_threshold(kThresholds[rng() % std::size(kThresholds)]);
      if (i % 16 == 0) alloc.empty_cache();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  run_workers(logs, target, 4000, total_ops() / kWorkers);
  workers_done.store(true);
  setter.join();
  require_clean(monitor.stop());
  require_no_errors(logs);

  REQUIRE(backend.ledger(0).peak <= kHighest);
  alloc.check_invariants();
  require_snapshot_matches(alloc, logs, 0);
  REQUIRE(alloc.stats().num_ooms == static_cast<std::int64_t>(total_ooms(logs)));

  // Quiescent: the last limit holds, except for segments that live blocks keep.
  alloc.set_limit(std::optional<std::size_t>(kFinal));
  alloc.empty_cache();
  REQUIRE(alloc.limit() == kFinal);
  if (alloc.reserved() > kFinal) {
    for (const SegmentInfo& s : alloc.snapshot()) {
      const bool holds_live = std::any_of(s.blocks.begin(), s.blocks.end(),
                                          [](const BlockInfo& b) { return b.state == BlockInfo::kAllocated; });
      CHECK(holds_live);
    }
  }
  free_all(logs, target);
  require_all_returned(alloc, backend, 0);
}
