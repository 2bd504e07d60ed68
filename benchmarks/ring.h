// The ring the allocator benchmarks on the simulated device share (bench_core.cpp,
// bench_adapter.cpp): one thread's ring of 64 live blocks over sizes drawn beforehand, log-uniform
// from 512 B to 64 MiB, freeing the oldest and allocating the next size. A Subject says what the
// ring allocates through: Handle, malloc(size, stream) and free(Handle&).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <random>
#include <vector>

#include "core/block.h"

namespace gpumem_bench {

constexpr std::size_t kRing = 64;

inline std::vector<std::size_t> log_uniform_sizes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(std::log(512.0), std::log(64.0 * (1 << 20)));
  std::vector<std::size_t> sizes(n);
  for (std::size_t& s : sizes) s = static_cast<std::size_t>(std::exp(u(rng)));
  return sizes;
}

inline double thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

// Aligned apart: two rings written by two threads must not share a cache line (or its prefetched
// pair), or the benchmark measures that. `pairs` sizes, from `seed`, repeat.
template <class Subject>
class alignas(128) Ring {
 public:
  Ring(Subject subject, gpumem::StreamId stream, std::size_t pairs, std::uint64_t seed)
      : subject_(subject), stream_(stream), sizes_(log_uniform_sizes(pairs, seed)) {
    for (auto& b : blocks_) b = subject_.malloc(next_size(), stream_);
  }
  ~Ring() {
    for (auto& b : blocks_) subject_.free(b);
  }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // The CPU time the thread spent on `pairs` pairs. Never inlined: callgrind counts it by name.
  [[gnu::noinline]] double run(std::size_t pairs) {
    const double start = thread_cpu_ns();
    for (std::size_t i = 0; i < pairs; ++i) {
      auto& slot = blocks_[oldest_];
      subject_.free(slot);
      slot = subject_.malloc(next_size(), stream_);
      oldest_ = oldest_ + 1 == kRing ? 0 : oldest_ + 1;
    }
    return thread_cpu_ns() - start;
  }

 private:
  std::size_t next_size() {
    const std::size_t size = sizes_[cursor_];
    cursor_ = cursor_ + 1 == sizes_.size() ? 0 : cursor_ + 1;
    return size;
  }

  Subject subject_;
  const gpumem::StreamId stream_;
  const std::vector<std::size_t> sizes_;
  typename Subject::Handle blocks_[kRing] = {};
  std::size_t oldest_ = 0;
  std::size_t cursor_ = 0;
};

}  // namespace gpumem_bench
