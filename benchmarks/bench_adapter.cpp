// The torch adapter's own cost, on the simulated device: ns and instructions per malloc+free pair
// through PyTorch's CUDAAllocator interface, with no GPU. Part 1 of docs/benchmarks.md measures the
// same calls on a GPU, where CUDA's share (the current device, the current stream) is in the
// figure too; here the current device and stream are a fake's, so what is left is gpumem's.
//
// One thread, one stream, sizes log-uniform 512 B to 64 MiB drawn beforehand, a ring of 64 live
// blocks as bench_core's. Two rings:
//   raw          raw_alloc_with_stream / raw_delete (what part 1 calls)
//   data_ptr     allocate() and the DataPtr's deleter (what torch.empty and a tensor's release call)
// Usage: bench_adapter [pairs per run, default 200000] [raw|data_ptr: that ring alone]
// tools/count_instructions.sh counts each ring's instructions per pair with callgrind.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/sim_backend.h"
#include "torch/allocator.h"

namespace {

using gpumem::StreamId;
using gpumem::TorchAllocator;
constexpr std::size_t kRing = 64;
constexpr int kRuns = 5;
constexpr std::size_t kCapacity = std::size_t{1} << 40;  // the device never runs out

struct FixedContext final : gpumem::CudaContext {
  int current_device() override { return 0; }
  StreamId current_stream(int) override { return 1; }
  void on_device(int, const std::function<void()>& f) override { f(); }
};

std::vector<std::size_t> log_uniform_sizes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> exponent(std::log2(512.0), std::log2(64.0 * (1 << 20)));
  std::vector<std::size_t> sizes(n);
  for (auto& s : sizes) s = static_cast<std::size_t>(std::exp2(exponent(rng)));
  return sizes;
}

struct Raw {
  using Handle = void*;
  TorchAllocator& a;
  Handle malloc(std::size_t size) { return a.raw_alloc_with_stream(size, reinterpret_cast<cudaStream_t>(1)); }
  void free(Handle ptr) { a.raw_delete(ptr); }
};
struct ByDataPtr {
  using Handle = c10::DataPtr;
  TorchAllocator& a;
  Handle malloc(std::size_t size) { return a.allocate(size); }
  void free(Handle& ptr) { ptr.clear(); }
};

template <class Subject>
class Ring {
 public:
  Ring(Subject subject, std::size_t pairs) : subject_(subject), sizes_(log_uniform_sizes(pairs, 1)) {
    for (auto& b : blocks_) b = subject_.malloc(next_size());
  }
  ~Ring() {
    for (auto& b : blocks_) subject_.free(b);
  }
  // Never inlined: callgrind counts it by name.
  [[gnu::noinline]] void run(std::size_t pairs) {
    for (std::size_t i = 0; i < pairs; ++i) {
      auto& slot = blocks_[oldest_];
      subject_.free(slot);
      slot = subject_.malloc(next_size());
      oldest_ = oldest_ + 1 == kRing ? 0 : oldest_ + 1;
    }
  }

 private:
  std::size_t next_size() {
    const std::size_t size = sizes_[cursor_];
    cursor_ = cursor_ + 1 == sizes_.size() ? 0 : cursor_ + 1;
    return size;
  }
  Subject subject_;
  const std::vector<std::size_t> sizes_;
  typename Subject::Handle blocks_[kRing] = {};
  std::size_t oldest_ = 0;
  std::size_t cursor_ = 0;
};

template <class Subject>
void bench(const char* name, std::size_t pairs) {
  gpumem::SimBackend backend(kCapacity, 1);
  TorchAllocator adapter(backend, std::make_unique<FixedContext>());
  Ring<Subject> ring(Subject{adapter}, pairs);
  ring.run(pairs);  // warm-up: the cache grows to what the sequence needs
  std::vector<double> ns;
  for (int r = 0; r < kRuns; ++r) {
    const auto start = std::chrono::steady_clock::now();
    ring.run(pairs);
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    ns.push_back(took.count() / static_cast<double>(pairs));
  }
  std::sort(ns.begin(), ns.end());
  std::printf("%-10s %8.1f ns per pair [%.1f .. %.1f]\n", name, ns[kRuns / 2], ns.front(), ns.back());
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t pairs = argc > 1 ? std::max<std::size_t>(std::strtoull(argv[1], nullptr, 10), 1) : 200000;
  const std::string only = argc > 2 ? argv[2] : "";
  std::printf("gpumem bench_adapter: TorchAllocator over the simulated device, one thread, ring of %zu blocks,\n"
              "sizes log-uniform 512 B..64 MiB; %zu pairs per run, median of %d runs [fastest .. slowest]\n",
              kRing, pairs, kRuns);
  if (only.empty() || only == "raw") bench<Raw>("raw", pairs);
  if (only.empty() || only == "data_ptr") bench<ByDataPtr>("data_ptr", pairs);
  return 0;
}
