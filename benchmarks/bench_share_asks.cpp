// How long asking the other processes on a shared GPU takes, on the simulated device: no GPU.
//
// Two processes (forked) are members of one table over one simulated 10 GiB device in shared
// memory (tests/cpp/shared_sim.h). A holds 6 GiB live, B 3 GiB live and 512 MiB of cache: the
// device is full. Each round both ask for 2 GiB at the same instant; each request ends with the
// memory or an out-of-memory error, and its time is recorded. Meanwhile, in A, another thread
// runs cached malloc+free pairs on another stream and records the longest one: what an ask costs
// the rest of its process. Printed: each process's request times (median, max) over the rounds,
// how many asks timed out (a member that did not answer within the 500 ms bound), and the longest
// cached pair in A during the rounds beside the longest in 500 ms before them, with nobody asking
// (what the machine's scheduling alone costs: on a loaded 2-core machine, milliseconds).
//
//   cmake -S . -B build-rel -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_TESTS=OFF
//   ninja -C build-rel bench_share_asks && ./build-rel/bench_share_asks [rounds]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "core/device_allocator.h"
#include "shared_sim.h"
#include "sharing/member.h"

namespace {

using gpumem::Block;
using gpumem::DeviceAllocator;
using gpumem::DeviceHost;
using gpumem::OutOfMemoryError;
using gpumem::ShareClient;
using Clock = std::chrono::steady_clock;

constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t MiB = std::size_t{1} << 20;

struct Shared {
  gpumem_test::SharedDevice* device;
  std::atomic<int> ready{0};
  std::atomic<int> round{-1};  // the round both start; -2: every round is done
  std::atomic<int> done{0};
};

struct Result {
  double request_ms[2];  // median, max
  unsigned long long timed_out;
  unsigned long long asks_made, asks_served;
  double longest_pair_ms;
  double longest_pair_alone_ms;  // the same pairs for 500 ms before the rounds, nobody asking
  int served;
};

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

Result member(Shared& shared, const std::string& table, std::size_t live, std::size_t cache, int rounds,
              bool run_pairs) {
  gpumem_test::SharedSim backend(*shared.device);
  gpumem::AllocatorConfig config;
  config.growable = false;
  DeviceAllocator alloc(backend, 0, config);
  DeviceHost host(alloc);
  ShareClient share(table, host, shared.device->capacity);
  alloc.set_share(&share);
  share.start();
  alloc.free(alloc.malloc(1 * MiB, 1));  // the other stream's cached block
  alloc.malloc(live, 0);
  if (cache) alloc.free(alloc.malloc(cache, 0));
  std::atomic<bool> stop{false};
  std::atomic<long long> longest_ns{0};
  long long baseline_ns = 0;
  std::thread pairs;
  if (run_pairs) {
    pairs = std::thread([&] {
      while (!stop.load()) {
        const auto start = Clock::now();
        alloc.free(alloc.malloc(1 * MiB, 1));
        const long long ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
        if (ns > longest_ns.load()) longest_ns.store(ns);
      }
    });
  }
  std::vector<double> times;
  int served = 0;
  if (run_pairs) {  // the same pairs with nobody asking: the machine's own noise, for comparison
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    baseline_ns = longest_ns.exchange(0);
  }
  shared.ready.fetch_add(1);
  for (int r = 0; r < rounds; ++r) {
    while (shared.round.load() < r) std::this_thread::sleep_for(std::chrono::microseconds(50));
    const auto start = Clock::now();
    try {
      alloc.free(alloc.malloc(2 * GiB, 0));
      ++served;
    } catch (const OutOfMemoryError&) {
    }
    times.push_back(ms(Clock::now() - start));
    shared.done.fetch_add(1);
  }
  while (shared.round.load() != -2) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // both done
  stop = true;
  if (pairs.joinable()) pairs.join();
  std::sort(times.begin(), times.end());
  Result result{{times[times.size() / 2], times.back()},
                share.status().asks_timed_out,
                share.status().asks_made,
                share.status().asks_served,
                static_cast<double>(longest_ns.load()) / 1e6,
                static_cast<double>(baseline_ns) / 1e6,
                served};
  share.stop();
  alloc.set_share(nullptr);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 50;
  char dir[] = "/tmp/gpumem-bench-share-XXXXXX";
  if (!::mkdtemp(dir)) return 1;
  const std::string table = std::string(dir) + "/share-GPU-bench.table";
  void* page = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  auto* shared = new (page) Shared;
  shared->device = &gpumem_test::SharedDevice::make(10 * GiB);
  int pipes[2][2];
  pid_t children[2];
  for (int who = 0; who < 2; ++who) {
    if (::pipe(pipes[who]) != 0) return 1;
    children[who] = ::fork();
    if (children[who] == 0) {
      const Result r = who == 0 ? member(*shared, table, 6 * GiB, 0, rounds, true)
                                : member(*shared, table, 3 * GiB, 512 * MiB, rounds, false);
      (void)!::write(pipes[who][1], &r, sizeof r);
      ::_exit(0);
    }
  }
  while (shared->ready.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // both responders running
  for (int r = 0; r < rounds; ++r) {
    shared->round.store(r);
    while (shared->done.load() < 2 * (r + 1)) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  shared->round.store(-2);
  const char* names[2] = {"A (6 GiB live)", "B (3 GiB live, 512 MiB cache)"};
  std::printf("two members asking each other for 2 GiB at once, %d rounds, simulated 10 GiB device\n", rounds);
  for (int who = 0; who < 2; ++who) {
    Result r{};
    if (::read(pipes[who][0], &r, sizeof r) != sizeof r) return 1;
    int status = 0;
    ::waitpid(children[who], &status, 0);
    std::printf("  %-28s request median %8.3f ms  max %8.3f ms  served %d/%d  asks made %llu, answered %llu, timed out %llu",
                names[who], r.request_ms[0], r.request_ms[1], r.served, rounds, r.asks_made, r.asks_served, r.timed_out);
    if (who == 0) {
      std::printf("\n  %-28s longest cached malloc+free on another stream: %.3f ms during the rounds, %.3f ms in "
                  "500 ms with nobody asking", "", r.longest_pair_ms, r.longest_pair_alone_ms);
    }
    std::printf("\n");
  }
  std::system((std::string("rm -rf ") + dir).c_str());
  return 0;
}
