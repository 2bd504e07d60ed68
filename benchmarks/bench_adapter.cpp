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
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/sim_backend.h"
#include "ring.h"
#include "torch/allocator.h"

namespace {

using gpumem::StreamId;
using gpumem::TorchAllocator;
using gpumem_bench::kRing;
constexpr int kRuns = 5;
constexpr std::size_t kCapacity = std::size_t{1} << 40;  // the device never runs out

struct FixedContext final : gpumem::CudaContext {
  int current_device() override { return 0; }
  StreamId current_stream(int) override { return 1; }
  void on_device(int, const std::function<void()>& f) override { f(); }
};

struct Raw {
  using Handle = void*;
  TorchAllocator& a;
  Handle malloc(std::size_t size, StreamId stream) { return a.raw_alloc_with_stream(size, reinterpret_cast<cudaStream_t>(stream)); }
  void free(Handle ptr) { a.raw_delete(ptr); }
};
// The stream is the context's current one (FixedContext: 1), as for a tensor.
struct ByDataPtr {
  using Handle = c10::DataPtr;
  TorchAllocator& a;
  Handle malloc(std::size_t size, StreamId) { return a.allocate(size); }
  void free(Handle& ptr) { ptr.clear(); }
};

template <class Subject>
void bench(const char* name, std::size_t pairs) {
  gpumem::SimBackend backend(kCapacity, 1);
  TorchAllocator adapter(backend, std::make_unique<FixedContext>());
  gpumem_bench::Ring<Subject> ring(Subject{adapter}, 1, pairs, 1);
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
