// Allocator cost through PyTorch's CUDAAllocator interface: ns per malloc+free pair.
//
// One process, one stream, the same sizes for every subject (log-uniform 512 B to 64 MiB, drawn
// beforehand so the RNG is not timed). Each subject keeps a ring of 64 live blocks: it frees the
// oldest and allocates the next size.
//   native      PyTorch's CUDACachingAllocator: torch's global allocator, never replaced here
//   gpumem      a gpumem::TorchAllocator over a CudaBackend, made here and not installed
//   cub         cub::CachingDeviceAllocator; bins 512 B to 64 MiB growing by 2, no cache cap (the
//               defaults stop caching at 2 MiB, which would make most of these sizes cudaMalloc)
//   cudaMalloc  cudaMalloc/cudaFree, with fewer pairs: every call goes to the driver
// native and gpumem are called through the same CUDAAllocator* (raw_alloc_with_stream, raw_delete).
// Each subject first runs once over the whole size list untimed, so timed pairs come from its
// cache; the segments it still had to get from CUDA while timed are reported. Runs alternate
// between the subjects; the figure is the median over runs of wall time / pairs.
//
// Usage: bench_allocators [--pairs N] [--runs R] [--cuda-pairs M] [--out FILE]   (JSON on stdout
// and in FILE). Built by benchmarks/build_bench_allocators.sh.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#if !GPUMEM_BENCH_NO_CUB  // set by the build script when the toolkit has no CUB headers
#include <cub/util_allocator.cuh>
#endif

#include "backends/cuda_backend.h"
#include "torch/allocator.h"

namespace {

using TorchCudaAllocator = c10::cuda::CUDACachingAllocator::CUDAAllocator;
using Clock = std::chrono::steady_clock;
constexpr std::size_t kRing = 64;

struct Options {
  std::size_t pairs = 200000;
  int runs = 7;
  std::size_t cuda_pairs = 2000;
  std::string out;
};

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

std::vector<std::size_t> log_uniform_sizes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(std::log(512.0), std::log(64.0 * (1 << 20)));
  std::vector<std::size_t> sizes(n);
  for (std::size_t& s : sizes) s = static_cast<std::size_t>(std::exp(u(rng)));
  return sizes;
}

// What the timing loop needs from a subject, whatever its ring's allocator.
class Timed {
 public:
  virtual ~Timed() = default;
  virtual double ns_per_pair(std::size_t pairs) = 0;
};

// A ring of live blocks over one allocator; alloc(bytes) -> void*, release(void*).
template <class Alloc, class Release>
class Ring final : public Timed {
 public:
  Ring(Alloc alloc, Release release, const std::vector<std::size_t>& sizes)
      : alloc_(alloc), release_(release), sizes_(sizes) {
    for (void*& p : live_) p = alloc_(next_size());
  }
  ~Ring() override {
    for (void* p : live_) release_(p);
  }

  double ns_per_pair(std::size_t pairs) override {
    const auto start = Clock::now();
    for (std::size_t i = 0; i < pairs; ++i) {
      void*& slot = live_[oldest_];
      release_(slot);
      slot = alloc_(next_size());
      oldest_ = oldest_ + 1 == kRing ? 0 : oldest_ + 1;
    }
    return std::chrono::duration<double, std::nano>(Clock::now() - start).count() / static_cast<double>(pairs);
  }

 private:
  std::size_t next_size() {
    const std::size_t size = sizes_[next_];
    next_ = next_ + 1 == sizes_.size() ? 0 : next_ + 1;
    return size;
  }

  Alloc alloc_;
  Release release_;
  const std::vector<std::size_t>& sizes_;
  std::size_t next_ = 0;
  std::size_t oldest_ = 0;
  std::array<void*, kRing> live_{};
};

template <class Alloc, class Release>
std::unique_ptr<Timed> make_ring(Alloc alloc, Release release, const std::vector<std::size_t>& sizes) {
  return std::make_unique<Ring<Alloc, Release>>(alloc, release, sizes);
}

// One allocator under test: its ring, how many segments it has had from CUDA (empty: it cannot
// say), and how to give its cache back.
struct Subject {
  Subject(std::string name_, std::size_t pairs_, std::unique_ptr<Timed> ring_)
      : name(std::move(name_)), pairs(pairs_), ring(std::move(ring_)) {}

  std::string name;
  std::size_t pairs;
  std::unique_ptr<Timed> ring;
  std::function<std::int64_t()> device_allocs;
  std::function<void()> trim;
  std::vector<double> ns;
  std::int64_t allocs_before = 0;
  std::int64_t allocs_timed = -1;  // segments obtained from CUDA during the timed runs; -1: unknown
};

Subject torch_subject(std::string name, TorchCudaAllocator* a, cudaStream_t stream,
                      const std::vector<std::size_t>& sizes, std::size_t pairs) {
  Subject s{std::move(name), pairs,
            make_ring([a, stream](std::size_t n) { return a->raw_alloc_with_stream(n, stream); },
                      [a](void* p) { a->raw_delete(p); }, sizes)};
  s.device_allocs = [a] { return static_cast<std::int64_t>(a->getDeviceStats(0).num_device_alloc); };
  return s;
}

// Torch's allocator, as a process that never imports gpumem has it; init() is what torch's lazy
// CUDA initialization would call.
Subject native_subject(int devices, cudaStream_t stream, const std::vector<std::size_t>& sizes, std::size_t pairs) {
  TorchCudaAllocator* native = c10::cuda::CUDACachingAllocator::allocator.load();
  native->init(devices);
  Subject s = torch_subject("native", native, stream, sizes, pairs);
  s.trim = [] { c10::cuda::CUDACachingAllocator::emptyCache(); };
  return s;
}

// Made here, never installed; leaked like the installed one (no DataPtr may outlive it).
Subject gpumem_subject(int devices, cudaStream_t stream, const std::vector<std::size_t>& sizes, std::size_t pairs) {
  auto* backend = new gpumem::CudaBackend;
  auto* ours = new gpumem::TorchAllocator(*backend, gpumem::make_torch_cuda_context());
  ours->init(devices);
  Subject s = torch_subject("gpumem", ours, stream, sizes, pairs);
  s.trim = [ours] {
    if (gpumem::DeviceAllocator* d = ours->core().existing(0)) d->empty_cache();
  };
  return s;
}

#if !GPUMEM_BENCH_NO_CUB
Subject cub_subject(cudaStream_t stream, const std::vector<std::size_t>& sizes, std::size_t pairs) {
  auto* a = new cub::CachingDeviceAllocator(2, 9, 26);  // bins 2^9 = 512 B to 2^26 = 64 MiB
  Subject s{"cub", pairs,
            make_ring(
                [a, stream](std::size_t n) {
                  void* p = nullptr;
                  check(a->DeviceAllocate(&p, n, stream), "cub DeviceAllocate");
                  return p;
                },
                [a](void* p) { check(a->DeviceFree(p), "cub DeviceFree"); }, sizes)};
  s.trim = [a] { check(a->FreeAllCached(), "cub FreeAllCached"); };
  return s;
}
#endif

Subject cuda_malloc_subject(const std::vector<std::size_t>& sizes, std::size_t pairs) {
  return {"cudaMalloc", pairs,
          make_ring(
              [](std::size_t n) {
                void* p = nullptr;
                check(cudaMalloc(&p, n), "cudaMalloc");
                return p;
              },
              [](void* p) { check(cudaFree(p), "cudaFree"); }, sizes)};
}

// A warm-up pass of `warm_up` pairs each, then `runs` timed runs, alternating between subjects.
void measure(std::vector<Subject>& subjects, int runs, std::size_t warm_up) {
  for (Subject& x : subjects) {
    x.ring->ns_per_pair(warm_up);
    if (x.device_allocs) x.allocs_before = x.device_allocs();
  }
  for (int r = 0; r < runs; ++r) {
    for (Subject& x : subjects) x.ns.push_back(x.ring->ns_per_pair(x.pairs));
  }
  for (Subject& x : subjects) {
    if (x.device_allocs) x.allocs_timed = x.device_allocs() - x.allocs_before;
    x.ring.reset();  // frees the ring's live blocks
    if (x.trim) x.trim();
    std::fprintf(stderr, "%s: %d runs done\n", x.name.c_str(), runs);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    if (!value) throw std::invalid_argument("missing value after " + arg);
    if (arg == "--pairs") o.pairs = std::stoull(value);
    else if (arg == "--runs") o.runs = std::stoi(value);
    else if (arg == "--cuda-pairs") o.cuda_pairs = std::stoull(value);
    else if (arg == "--out") o.out = value;
    else throw std::invalid_argument("unknown argument " + arg);
    ++i;
  }
  if (o.pairs == 0 || o.runs <= 0 || o.cuda_pairs == 0) throw std::invalid_argument("counts must be positive");
  return o;
}

std::string json(const Options& o, const std::string& native_name, const std::vector<Subject>& subjects) {
  const double native_median = median(subjects[0].ns);
  std::string s = "{\"native_backend\": \"" + native_name + "\", \"pairs\": " + std::to_string(o.pairs) +
                  ", \"cuda_pairs\": " + std::to_string(o.cuda_pairs) + ", \"runs\": " + std::to_string(o.runs) +
                  ", \"ring\": " + std::to_string(kRing) + ", \"subjects\": {";
  for (std::size_t i = 0; i < subjects.size(); ++i) {
    const Subject& x = subjects[i];
    const double m = median(x.ns);
    char head[256];
    std::snprintf(head, sizeof head, "%s\"%s\": {\"pairs\": %zu, \"ns_per_pair\": %.1f, \"ratio_to_native\": %.4f, ",
                  i ? ", " : "", x.name.c_str(), x.pairs, m, m / native_median);
    s += head;
    s += "\"device_allocs_while_timed\": " + std::to_string(x.allocs_timed);
    s += ", \"ns_per_pair_runs\": [";
    for (std::size_t r = 0; r < x.ns.size(); ++r) {
      char v[32];
      std::snprintf(v, sizeof v, "%s%.1f", r ? ", " : "", x.ns[r]);
      s += v;
    }
    s += "]}";
  }
  return s + "}}\n";
}

int run(const Options& o) {
  const int devices = c10::cuda::device_count();
  if (devices == 0) throw std::runtime_error("no CUDA device: this benchmark needs a GPU");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const std::vector<std::size_t> sizes = log_uniform_sizes(o.pairs, 42);

  std::vector<Subject> cached;
  cached.push_back(native_subject(devices, stream, sizes, o.pairs));
  cached.push_back(gpumem_subject(devices, stream, sizes, o.pairs));
#if !GPUMEM_BENCH_NO_CUB
  cached.push_back(cub_subject(stream, sizes, o.pairs));
#endif
  measure(cached, o.runs, o.pairs);  // warm-up: one pass over every size
  // After the caches are given back, so that cudaMalloc has the device to itself.
  std::vector<Subject> bare;
  bare.push_back(cuda_malloc_subject(sizes, o.cuda_pairs));
  measure(bare, std::max(3, o.runs / 2), std::min<std::size_t>(o.cuda_pairs, 256));

  std::vector<Subject> subjects = std::move(cached);
  subjects.push_back(std::move(bare.front()));
  const std::string native_name = c10::cuda::CUDACachingAllocator::allocator.load()->name();
  const std::string text = json(o, native_name, subjects);
  std::fputs(text.c_str(), stdout);
  if (!o.out.empty()) {
    FILE* f = std::fopen(o.out.c_str(), "w");
    if (!f) throw std::runtime_error("cannot write " + o.out);
    std::fputs(text.c_str(), f);
    std::fclose(f);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allocators: %s\n", e.what());
    return 1;
  }
}
