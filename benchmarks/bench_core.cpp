// The cost of the cached path: malloc+free pairs through DeviceAllocator's Block* API.
//
// Each thread keeps a ring of 64 live blocks: it frees the oldest and allocates the next size, drawn
// log-uniformly from 512 B to 64 MiB and generated beforehand so the RNG is not timed. The device is
// simulated (SimBackend) with a large capacity and no limit, and a warm-up pass runs first, so the
// timed pairs are served from the cache; the share that still reached the backend is printed.
//
// A row "1 thread, by address" runs the same ring through CachingAllocator's raw_alloc and raw_free:
// what a caller that frees by address (PyTorch's raw_alloc, raw_delete) pays, the table of
// addresses (core/address_table.h) included.
//
// An optional argument replaces the 1,000,000 pairs per run (a profiler wants fewer); a second,
// `one-thread`, runs the two one-thread rings alone (tools/count_instructions.sh counts their
// instructions per pair under callgrind, a figure the 2-core machines' noise does not move).
//
// Figures need a Release build with the invariant checker compiled out:
//   cmake -S . -B build-rel -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_TESTS=OFF
//         -DGPUMEM_CHECK_INVARIANTS=OFF && ninja -C build-rel bench_core && ./build-rel/bench_core
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/sim_backend.h"
#include "core/caching_allocator.h"
#include "core/device_allocator.h"
#include "ring.h"

namespace {

using gpumem::Block;
using gpumem::CachingAllocator;
using gpumem::DeviceAllocator;
using gpumem::SimBackend;
using gpumem::StreamId;

using gpumem_bench::kRing;
using gpumem_bench::Ring;
using gpumem_bench::thread_cpu_ns;
constexpr int kRuns = 5;
// The targets: one thread on the cached path, and two threads in parallel against one.
constexpr double kTargetNs = 70.0;
constexpr double kTwoThreadShare = 0.6;
constexpr std::size_t kCapacity = std::size_t{1} << 40;  // 1 TiB: the device never runs out
using Clock = std::chrono::steady_clock;

std::size_t pairs_per_run = 1000000;  // per thread; set once, from the command line

// What a ring allocates through: the device allocator's blocks, or addresses (raw_alloc, raw_free).
struct ByBlock {
  using Handle = Block*;
  DeviceAllocator& alloc;
  Handle malloc(std::size_t size, StreamId stream) { return alloc.malloc(size, stream); }
  void free(Handle block) { alloc.free(block); }
};
// The same calls as ByBlock, a type of its own so that tools/count_instructions.sh, which counts
// Ring<ByBlock>::run, counts the plain-segment ring alone.
struct ByBlockGrowable : ByBlock {};
struct ByAddress {
  using Handle = void*;
  CachingAllocator& alloc;
  Handle malloc(std::size_t size, StreamId stream) { return alloc.raw_alloc(0, size, stream); }
  void free(Handle ptr) { alloc.raw_free(ptr); }
};

template <class Subject>
using Rings = std::vector<std::unique_ptr<Ring<Subject>>>;

struct RunTime {
  double wall_ns;
  double cpu_ns;  // mean over the threads
};

// Every ring runs `pairs_per_run` pairs on its own thread, all released at once.
template <class Subject>
RunTime timed_run(Rings<Subject>& rings) {
  if (rings.size() == 1) {
    const auto start = Clock::now();
    const double cpu = rings[0]->run(pairs_per_run);
    return {std::chrono::duration<double, std::nano>(Clock::now() - start).count(), cpu};
  }
  std::atomic<std::size_t> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> cpu(rings.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < rings.size(); ++i) {
    threads.emplace_back([&, i] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      cpu[i] = rings[i]->run(pairs_per_run);
    });
  }
  while (ready.load() != rings.size()) {
  }
  const auto start = Clock::now();
  go.store(true, std::memory_order_release);
  for (std::thread& t : threads) t.join();
  const double wall = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
  double cpu_sum = 0;
  for (double c : cpu) cpu_sum += c;
  return {wall, cpu_sum / static_cast<double>(rings.size())};
}

std::uint64_t backend_calls(const SimBackend& backend) {
  std::uint64_t calls = 0;
  for (int d = 0; d < backend.device_count(); ++d) {
    const SimBackend::Ledger l = backend.ledger(d);
    calls += l.reserves + l.releases + l.maps + l.unmaps;
  }
  return calls;
}

// The cache the timed runs work against.
struct CacheState {
  std::size_t segments = 0;
  std::size_t free_blocks = 0;
  std::size_t reserved = 0;
};

CacheState cache_state(const std::vector<const DeviceAllocator*>& allocs) {
  CacheState state;
  for (const DeviceAllocator* a : allocs) {
    state.reserved += a->reserved();
    for (const gpumem::SegmentInfo& s : a->snapshot()) {
      ++state.segments;
      for (const gpumem::BlockInfo& b : s.blocks) state.free_blocks += b.state == gpumem::BlockInfo::kFree;
    }
  }
  return state;
}

struct Figures {
  double wall_ns;            // per pair, wall time / the pairs of one thread: what each caller sees
  double min_ns, max_ns;     // of wall_ns over the runs
  double cpu_ns;             // per pair, the thread's CPU time: wall_ns without the time other processes took
  double aggregate_ns;       // per pair, wall time / the pairs of all threads: the throughput of the whole
  double backend_share;      // backend calls per timed pair: with no limit, only a cache miss calls it, once
  double lane_share;         // of the timed mallocs and frees, those a stream's lane served alone
  CacheState cache;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Subject>
Figures measure(SimBackend& backend, Rings<Subject>& rings, const std::vector<const DeviceAllocator*>& allocs) {
  for (auto& ring : rings) ring->run(pairs_per_run);  // warm-up: the cache grows to what the sequence needs
  const std::uint64_t calls_before = backend_calls(backend);
  std::uint64_t on_device_before = 0;
  for (const DeviceAllocator* a : allocs) on_device_before += a->work_counts().on_device;
  std::vector<double> wall, cpu;
  for (int r = 0; r < kRuns; ++r) {
    const RunTime t = timed_run(rings);
    wall.push_back(t.wall_ns / static_cast<double>(pairs_per_run));
    cpu.push_back(t.cpu_ns / static_cast<double>(pairs_per_run));
  }
  const double pairs_all = static_cast<double>(pairs_per_run) * static_cast<double>(rings.size()) * kRuns;
  Figures f;
  f.wall_ns = median(wall);
  f.min_ns = *std::min_element(wall.begin(), wall.end());
  f.max_ns = *std::max_element(wall.begin(), wall.end());
  f.cpu_ns = median(cpu);
  f.aggregate_ns = f.wall_ns / static_cast<double>(rings.size());
  f.backend_share = static_cast<double>(backend_calls(backend) - calls_before) / pairs_all;
  std::uint64_t on_device = 0;
  for (const DeviceAllocator* a : allocs) on_device += a->work_counts().on_device;
  f.lane_share = 1.0 - static_cast<double>(on_device - on_device_before) / (2 * pairs_all);
  f.cache = cache_state(allocs);
  return f;
}

// `target`: what the row is held to, and whether it met it.
// A row with no target of its own passes its note as `target` and no verdict.
void print(const char* name, const Figures& f, const std::string& target, const char* verdict) {
  std::printf("%-36s %8.1f ns [%7.1f .. %7.1f]  cpu %7.1f ns  aggregate %7.1f ns  %s%s%s\n", name, f.wall_ns,
              f.min_ns, f.max_ns, f.cpu_ns, f.aggregate_ns, target.c_str(), verdict ? ": " : "", verdict ? verdict : "");
  std::printf("%-36s pairs that reached the backend: %.4f%%; calls served in lanes: %.2f%%; cache: %zu segments, "
              "%.2f GiB, %zu free blocks\n", "", 100.0 * f.backend_share, 100.0 * f.lane_share, f.cache.segments, static_cast<double>(f.cache.reserved) / (1 << 30),
              f.cache.free_blocks);
}

// Two threads are held to a share of one thread's time per pair: they should run in parallel.
void print_against(const char* name, const Figures& f, const Figures& one) {
  const double ratio = f.aggregate_ns / one.wall_ns;
  char target[96];
  std::snprintf(target, sizeof target, "aggregate %.2f x 1 thread, target <= %.1f", ratio, kTwoThreadShare);
  print(name, f, target, ratio <= kTwoThreadShare ? "met" : "MISSED");
}

const gpumem::AllocatorConfig kNoLimit{};

Figures bench_one_thread() {
  SimBackend backend(kCapacity);
  DeviceAllocator alloc(backend, 0, kNoLimit);
  Rings<ByBlock> rings;
  rings.push_back(std::make_unique<Ring<ByBlock>>(ByBlock{alloc}, 0, pairs_per_run, 1));
  const Figures f = measure(backend, rings, {&alloc});
  print("1 thread", f, "target < " + std::to_string(static_cast<int>(kTargetNs)) + " ns", f.wall_ns < kTargetNs ? "met" : "MISSED");
  return f;
}

// The same ring on growable segments (2 MiB pages): what the cached path costs where the cache can
// be remapped, and how often the ring's changing holes still reach the backend.
void bench_one_thread_growable(const Figures& one) {
  SimBackend backend(kCapacity);
  backend.enable_virtual_memory(std::size_t{2} << 20);
  DeviceAllocator alloc(backend, 0, kNoLimit);
  Rings<ByBlockGrowable> rings;
  rings.push_back(std::make_unique<Ring<ByBlockGrowable>>(ByBlockGrowable{{alloc}}, 0, pairs_per_run, 1));
  const Figures f = measure(backend, rings, {&alloc});
  char against[64];
  std::snprintf(against, sizeof against, "%.2f x plain segments", f.wall_ns / one.wall_ns);
  print("1 thread, growable segments", f, against, nullptr);
}

// The same ring by address, against the one above: no target of its own.
void bench_one_thread_by_address(const Figures& one) {
  SimBackend backend(kCapacity);
  CachingAllocator alloc(backend, kNoLimit);
  Rings<ByAddress> rings;
  rings.push_back(std::make_unique<Ring<ByAddress>>(ByAddress{alloc}, 0, pairs_per_run, 1));
  const Figures f = measure(backend, rings, {&alloc.device(0)});
  char against[64];
  std::snprintf(against, sizeof against, "%.2f x by block", f.wall_ns / one.wall_ns);
  print("1 thread, by address", f, against, nullptr);
}

// `threads` threads on streams of their own of one device: two are held to the target; more are
// printed against one thread with no target of their own (the host's cores and its memory
// system set what is reachable).
void bench_own_streams(const Figures& one, int threads) {
  SimBackend backend(kCapacity);
  DeviceAllocator alloc(backend, 0, kNoLimit);
  Rings<ByBlock> rings;
  for (int t = 1; t <= threads; ++t) {
    rings.push_back(std::make_unique<Ring<ByBlock>>(ByBlock{alloc}, static_cast<gpumem::StreamId>(t), pairs_per_run, static_cast<std::uint64_t>(t)));
  }
  const std::string name = std::to_string(threads) + " threads, one device, own streams";
  const Figures f = measure(backend, rings, {&alloc});
  if (threads == 2) {
    print_against(name.c_str(), f, one);
    return;
  }
  char against[64];
  std::snprintf(against, sizeof against, "aggregate %.2f x 1 thread (1/%d = %.2f)", f.aggregate_ns / one.wall_ns, threads,
                1.0 / threads);
  print(name.c_str(), f, against, nullptr);
}

void bench_two_devices(const Figures& one) {
  SimBackend backend(kCapacity, 2);
  DeviceAllocator alloc0(backend, 0, kNoLimit);
  DeviceAllocator alloc1(backend, 1, kNoLimit);
  Rings<ByBlock> rings;
  rings.push_back(std::make_unique<Ring<ByBlock>>(ByBlock{alloc0}, 0, pairs_per_run, 1));
  rings.push_back(std::make_unique<Ring<ByBlock>>(ByBlock{alloc1}, 0, pairs_per_run, 2));
  print_against("2 threads, own devices", measure(backend, rings, {&alloc0, &alloc1}), one);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) pairs_per_run = std::max<std::size_t>(std::strtoull(argv[1], nullptr, 10), 1);
  std::printf("gpumem bench_core: malloc+free pairs, sizes log-uniform 512 B..64 MiB, ring of %zu live blocks\n", kRing);
  std::printf("SimBackend, no limit, after a warm-up pass; %zu pairs per thread per run, median of %d runs\n", pairs_per_run,
              kRuns);
  std::printf("ns per pair: wall time / the pairs of one thread, median [fastest .. slowest run]; cpu: the same in\n"
              "thread CPU time (unaffected by other processes); aggregate: wall time / the pairs of all threads\n");
#if GPUMEM_CHECK_INVARIANTS
  std::printf("WARNING: built with GPUMEM_CHECK_INVARIANTS: every malloc and free walks all segments; configure\n"
              "         with -DGPUMEM_CHECK_INVARIANTS=OFF for the figures of a release build\n");
#endif
  std::printf("\n");
  const Figures one = bench_one_thread();
  bench_one_thread_by_address(one);
  bench_one_thread_growable(one);
  if (argc > 2 && std::string(argv[2]) == "one-thread") return 0;
  bench_own_streams(one, 2);
  bench_two_devices(one);
  for (const int threads : {4, 8}) bench_own_streams(one, threads);
  return 0;
}
