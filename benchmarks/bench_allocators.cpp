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
// Threads mode (--threads 1,2,4,8,16): native and gpumem only, through the same CUDAAllocator*.
// Each thread has its own ring of 64 live blocks over its own sizes (log-uniform 512 B to 64 MiB,
// thread i's from seed 42 + i, the same for both subjects) and its own non-blocking stream
// ("own"), or the threads share --shared-streams streams, thread i on stream i % S ("shared";
// run only where there are more threads than streams, since otherwise it is "own"). The same
// streams serve every thread count, so no allocator sees more than max(threads) streams. For each
// count and stream mode: both subjects' rings are made and warmed by one untimed pass over every
// thread's sizes, all threads at once; then runs alternate between the subjects. In a run every
// thread waits for one start flag; the wall time runs from the flag to the last thread's end. The
// figure is aggregate pairs per second (threads x pairs per thread / the median wall time), with
// the runs' spread; afterwards the rings are freed and both caches emptied, and a subject that
// still has bytes allocated fails the benchmark.
//
// Usage: bench_allocators [--pairs N] [--runs R] [--cuda-pairs M] [--out FILE]   (JSON on stdout
// and in FILE).
//        bench_allocators --threads 1,2,4,8,16 [--streams own,shared] [--shared-streams S]
//                         [--pairs N per thread, default 4000] [--runs R, default 5] [--out FILE]
//        (a table, then the JSON, on stdout; the JSON in FILE.)
// Built by benchmarks/build_bench_allocators.sh.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
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
  std::size_t pairs = 200000;  // per run; in threads mode per thread and run
  int runs = 7;
  std::size_t cuda_pairs = 2000;
  std::string out;
  std::vector<int> threads;  // threads mode's thread counts; empty: the one-stream mode
  std::vector<std::string> stream_modes{"own", "shared"};
  int shared_streams = 2;
};

constexpr std::size_t kThreadPairs = 4000;  // threads mode's default pairs per thread and run
constexpr int kThreadRuns = 5;
constexpr int kMaxThreads = 256;
// A run, or the wait for every thread to be ready, that takes longer than this is a hang: the
// process says so and exits rather than wait for an outer timeout.
constexpr std::chrono::seconds kRunDeadline{60};

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
    for (void* p : live_) {
      try {
        release_(p);
      } catch (const std::exception& e) {  // a destructor must not throw: say it, go on
        std::fprintf(stderr, "bench_allocators: freeing a ring's block failed: %s\n", e.what());
      }
    }
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

// An allocator behind torch's interface, and how to give its cache back.
struct TorchSubject {
  std::string name;
  TorchCudaAllocator* allocator;
  std::function<void()> trim;
};

// Torch's allocator, as a process that never imports gpumem has it; init() is what torch's lazy
// CUDA initialization would call.
TorchSubject native_allocator(int devices) {
  TorchCudaAllocator* native = c10::cuda::CUDACachingAllocator::allocator.load();
  native->init(devices);
  return {"native", native, [] { c10::cuda::CUDACachingAllocator::emptyCache(); }};
}

// Made here, never installed; leaked like the installed one (no DataPtr may outlive it).
TorchSubject gpumem_allocator(int devices) {
  auto* backend = new gpumem::CudaBackend;
  auto* ours = new gpumem::TorchAllocator(*backend, gpumem::make_torch_cuda_context());
  ours->init(devices);
  return {"gpumem", ours, [ours] {
            if (gpumem::DeviceAllocator* d = ours->core().existing(0)) d->empty_cache();
          }};
}

std::unique_ptr<Timed> torch_ring(TorchCudaAllocator* a, cudaStream_t stream, const std::vector<std::size_t>& sizes) {
  return make_ring([a, stream](std::size_t n) { return a->raw_alloc_with_stream(n, stream); },
                   [a](void* p) { a->raw_delete(p); }, sizes);
}

std::int64_t device_allocs(TorchCudaAllocator* a) {
  return static_cast<std::int64_t>(a->getDeviceStats(0).num_device_alloc);
}

Subject torch_subject(const TorchSubject& t, cudaStream_t stream, const std::vector<std::size_t>& sizes,
                      std::size_t pairs) {
  Subject s{t.name, pairs, torch_ring(t.allocator, stream, sizes)};
  TorchCudaAllocator* a = t.allocator;
  s.device_allocs = [a] { return device_allocs(a); };
  s.trim = t.trim;
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

void write_file(const std::string& path, const std::string& text) {
  if (path.empty()) return;
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  const bool written = std::fputs(text.c_str(), f) >= 0;
  if (std::fclose(f) != 0 || !written) throw std::runtime_error("cannot write " + path);
}

// ---- Threads mode ----

[[noreturn]] void hang(const std::string& what) {
  std::fprintf(stderr, "bench_allocators: %s took over %lld s: stopping (a hang?)\n", what.c_str(),
               static_cast<long long>(kRunDeadline.count()));
  std::fflush(stderr);
  std::_Exit(3);  // threads may be stuck inside an allocator: no destructor could run safely
}

// Threads that run their rings together, one ring each. A run hands every thread the pair count,
// waits until all are ready, and raises one start flag; its wall time runs from the flag to the
// last thread's end. A thread's error is rethrown by the run.
class Team {
 public:
  explicit Team(std::vector<std::unique_ptr<Timed>> rings) : rings_(std::move(rings)), ends_(rings_.size()) {
    for (std::size_t i = 0; i < rings_.size(); ++i) threads_.emplace_back([this, i] { work(i); });
  }
  ~Team() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }  // then rings_ goes, freeing the live blocks

  double wall_ns(std::size_t pairs) {
    const std::size_t n = rings_.size();
    std::uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> l(m_);
      pairs_ = pairs;
      done_ = 0;
      ready_.store(0);
      generation = ++generation_;
    }
    wake_.notify_all();
    const auto deadline = Clock::now() + kRunDeadline;
    while (ready_.load(std::memory_order_acquire) != n) {
      if (Clock::now() > deadline) hang("waiting for " + std::to_string(n) + " threads to be ready");
      std::this_thread::yield();
    }
    const auto start = Clock::now();
    go_.store(generation, std::memory_order_release);
    std::unique_lock<std::mutex> l(m_);
    if (!finished_.wait_until(l, start + kRunDeadline, [&] { return done_ == n; }))
      hang("a run of " + std::to_string(n) + " threads x " + std::to_string(pairs) + " pairs");
    if (!error_.empty()) throw std::runtime_error(error_);
    const auto last = *std::max_element(ends_.begin(), ends_.end());
    return std::chrono::duration<double, std::nano>(last - start).count();
  }

 private:
  void work(std::size_t i) {
    std::uint64_t seen = 0;
    std::string error;
    try {
      c10::cuda::set_device(0);  // the device the streams are on
    } catch (const std::exception& e) {
      error = e.what();
    }
    for (;;) {
      std::size_t pairs = 0;
      {
        std::unique_lock<std::mutex> l(m_);
        wake_.wait(l, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        pairs = pairs_;
      }
      ready_.fetch_add(1, std::memory_order_acq_rel);
      while (go_.load(std::memory_order_acquire) != seen) std::this_thread::yield();
      if (error.empty()) {
        try {
          rings_[i]->ns_per_pair(pairs);
        } catch (const std::exception& e) {
          error = e.what();
        }
      }
      const auto end = Clock::now();
      {
        std::lock_guard<std::mutex> l(m_);
        ends_[i] = end;
        if (!error.empty() && error_.empty()) error_ = "thread " + std::to_string(i) + ": " + error;
        ++done_;
      }
      finished_.notify_one();
    }
  }

  std::vector<std::unique_ptr<Timed>> rings_;
  std::vector<Clock::time_point> ends_;
  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable wake_, finished_;
  std::uint64_t generation_ = 0;  // guarded by m_, as are pairs_, stop_, done_, ends_, error_
  std::size_t pairs_ = 0;
  bool stop_ = false;
  std::size_t done_ = 0;
  std::string error_;
  std::atomic<std::size_t> ready_{0};
  std::atomic<std::uint64_t> go_{0};
};

// One subject at one thread count and stream mode: each run's wall time.
struct ThreadsResult {
  std::vector<double> wall_ns;
  std::int64_t allocs_timed = 0;
};

struct ThreadsCase {
  std::string streams;  // "own" or "shared"
  int threads = 0;
  int distinct_streams = 0;
  std::vector<ThreadsResult> subjects;  // as ordered in the subject list
};

// Bytes a subject still has allocated: after its rings are gone, anything is a leak between cases.
std::int64_t allocated_now(TorchCudaAllocator* a) { return a->getDeviceStats(0).allocated_bytes[0].current; }

ThreadsCase measure_threads(const std::vector<TorchSubject>& subjects, const std::vector<cudaStream_t>& streams,
                            const std::vector<std::vector<std::size_t>>& sizes, const std::string& mode,
                            int threads, const Options& o) {
  ThreadsCase c{mode, threads, mode == "own" ? threads : std::min(threads, o.shared_streams), {}};
  std::vector<std::unique_ptr<Team>> teams;
  for (const TorchSubject& s : subjects) {
    std::vector<std::unique_ptr<Timed>> rings;
    for (int i = 0; i < threads; ++i)
      rings.push_back(torch_ring(s.allocator, streams[mode == "own" ? i : i % o.shared_streams], sizes[i]));
    teams.push_back(std::make_unique<Team>(std::move(rings)));
    teams.back()->wall_ns(o.pairs);  // warm-up: every thread's sizes once, all threads at once
  }
  c.subjects.resize(subjects.size());
  for (std::size_t k = 0; k < subjects.size(); ++k) c.subjects[k].allocs_timed = -device_allocs(subjects[k].allocator);
  for (int r = 0; r < o.runs; ++r) {
    for (std::size_t j = 0; j < subjects.size(); ++j) {
      const std::size_t k = r % 2 ? subjects.size() - 1 - j : j;  // the order flips run by run
      c.subjects[k].wall_ns.push_back(teams[k]->wall_ns(o.pairs));
    }
  }
  for (std::size_t k = 0; k < subjects.size(); ++k) {
    c.subjects[k].allocs_timed += device_allocs(subjects[k].allocator);
    teams[k].reset();  // joins the threads, frees the rings' blocks
    subjects[k].trim();
    if (const std::int64_t left = allocated_now(subjects[k].allocator))
      throw std::runtime_error(subjects[k].name + " still has " + std::to_string(left) + " bytes allocated after " +
                               mode + " streams, " + std::to_string(threads) + " threads");
  }
  return c;
}

double pairs_per_s(const ThreadsCase& c, double wall_ns, const Options& o) {
  return static_cast<double>(c.threads) * static_cast<double>(o.pairs) / (wall_ns * 1e-9);
}

std::string threads_json(const Options& o, const std::string& native_name, const std::vector<TorchSubject>& subjects,
                         const std::vector<ThreadsCase>& cases) {
  char head[512];
  std::snprintf(head, sizeof head,
                "{\"mode\": \"threads\", \"native_backend\": \"%s\", \"pairs_per_thread\": %zu, \"runs\": %d, "
                "\"ring\": %zu, \"shared_streams\": %d, \"sizes\": \"log-uniform 512 B to 64 MiB, thread i's "
                "from seed 42 + i\", \"cases\": [",
                native_name.c_str(), o.pairs, o.runs, kRing, o.shared_streams);
  std::string s = head;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const ThreadsCase& c = cases[i];
    char line[256];
    std::snprintf(line, sizeof line,
                  "%s{\"streams\": \"%s\", \"threads\": %d, \"distinct_streams\": %d, \"subjects\": {",
                  i ? ", " : "", c.streams.c_str(), c.threads, c.distinct_streams);
    s += line;
    std::vector<double> rates;
    for (std::size_t k = 0; k < subjects.size(); ++k) {
      const ThreadsResult& x = c.subjects[k];
      const double wall = median(x.wall_ns);
      rates.push_back(pairs_per_s(c, wall, o));
      std::snprintf(line, sizeof line,
                    "%s\"%s\": {\"pairs_per_s\": %.0f, \"ns_per_pair\": %.1f, \"device_allocs_while_timed\": %lld, "
                    "\"pairs_per_s_runs\": [",
                    k ? ", " : "", subjects[k].name.c_str(), rates.back(),
                    wall / (static_cast<double>(c.threads) * static_cast<double>(o.pairs)),
                    static_cast<long long>(x.allocs_timed));
      s += line;
      for (std::size_t r = 0; r < x.wall_ns.size(); ++r) {
        std::snprintf(line, sizeof line, "%s%.0f", r ? ", " : "", pairs_per_s(c, x.wall_ns[r], o));
        s += line;
      }
      s += "]}";
    }
    std::snprintf(line, sizeof line, "}, \"gpumem_over_native\": %.4f}", rates[1] / rates[0]);
    s += line;
  }
  return s + "]}\n";
}

// The readable table: per case, each subject's median rate with its runs' spread, and the ratio.
void print_threads_table(const Options& o, const std::vector<TorchSubject>& subjects,
                         const std::vector<ThreadsCase>& cases) {
  std::printf("%zu pairs per thread and run, median of %d runs (min-max), aggregate Mpairs/s\n", o.pairs, o.runs);
  std::printf("%-7s %7s %8s", "streams", "threads", "distinct");
  for (const TorchSubject& s : subjects) std::printf("  %-24s", (s.name + " Mpairs/s").c_str());
  std::printf("  gpumem/native\n");
  for (const ThreadsCase& c : cases) {
    std::printf("%-7s %7d %8d", c.streams.c_str(), c.threads, c.distinct_streams);
    std::vector<double> rates;
    for (const ThreadsResult& x : c.subjects) {
      const auto [low, high] = std::minmax_element(x.wall_ns.begin(), x.wall_ns.end());
      rates.push_back(pairs_per_s(c, median(x.wall_ns), o));
      char cell[64];
      std::snprintf(cell, sizeof cell, "%.3f (%.3f-%.3f)", rates.back() / 1e6, pairs_per_s(c, *high, o) / 1e6,
                    pairs_per_s(c, *low, o) / 1e6);
      std::printf("  %-24s", cell);
    }
    std::printf("  %.3f\n", rates[1] / rates[0]);
  }
}

int run_threads(const Options& o) {
  const int devices = c10::cuda::device_count();
  if (devices == 0) throw std::runtime_error("no CUDA device: this benchmark needs a GPU");
  const int most = *std::max_element(o.threads.begin(), o.threads.end());
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(std::max(most, o.shared_streams)));
  for (cudaStream_t& s : streams) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<std::vector<std::size_t>> sizes;
  for (int i = 0; i < most; ++i) sizes.push_back(log_uniform_sizes(o.pairs, 42 + static_cast<std::uint64_t>(i)));

  const std::vector<TorchSubject> subjects{native_allocator(devices), gpumem_allocator(devices)};  // native first
  std::vector<ThreadsCase> cases;
  for (const std::string& mode : o.stream_modes) {
    for (int threads : o.threads) {
      if (mode == "shared" && threads <= o.shared_streams) continue;  // one stream each: that is "own"
      cases.push_back(measure_threads(subjects, streams, sizes, mode, threads, o));
      std::fprintf(stderr, "%s streams, %d threads: done\n", mode.c_str(), threads);
    }
  }
  if (cases.empty()) throw std::invalid_argument("no case to run: \"shared\" needs more threads than --shared-streams");
  print_threads_table(o, subjects, cases);
  const std::string text = threads_json(o, subjects[0].allocator->name(), subjects, cases);
  std::fputs(text.c_str(), stdout);
  write_file(o.out, text);
  return 0;
}

// A count of at most `most`: digits only, checked before use.
std::size_t count(const std::string& arg, const std::string& value, std::size_t most) {
  const bool digits = !value.empty() && value.size() <= 12 &&
                      std::all_of(value.begin(), value.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  const std::size_t n = digits ? std::stoull(value) : 0;
  if (n == 0 || n > most)
    throw std::invalid_argument(arg + " wants a count from 1 to " + std::to_string(most) + ", not \"" + value + "\"");
  return n;
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> parts;
  std::size_t from = 0;
  for (std::size_t comma; (comma = list.find(',', from)) != std::string::npos; from = comma + 1)
    parts.push_back(list.substr(from, comma - from));
  parts.push_back(list.substr(from));
  return parts;
}

Options parse(int argc, char** argv) {
  Options o;
  bool pairs_given = false, runs_given = false, cuda_pairs_given = false;
  std::vector<std::string> thread_flags;  // flags that only threads mode reads
  constexpr std::size_t kMostPairs = 1000000000;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    if (!value) throw std::invalid_argument("missing value after " + arg);
    if (arg == "--pairs") o.pairs = count(arg, value, kMostPairs), pairs_given = true;
    else if (arg == "--runs") o.runs = static_cast<int>(count(arg, value, 1000)), runs_given = true;
    else if (arg == "--cuda-pairs") o.cuda_pairs = count(arg, value, kMostPairs), cuda_pairs_given = true;
    else if (arg == "--out") o.out = value;
    else if (arg == "--threads") {
      o.threads.clear();
      for (const std::string& n : split(value)) o.threads.push_back(static_cast<int>(count(arg, n, kMaxThreads)));
    } else if (arg == "--streams") {
      o.stream_modes = split(value);
      for (const std::string& m : o.stream_modes)
        if (m != "own" && m != "shared")
          throw std::invalid_argument("--streams takes own, shared or own,shared, not \"" + m + "\"");
      thread_flags.push_back(arg);
    } else if (arg == "--shared-streams") {
      o.shared_streams = static_cast<int>(count(arg, value, kMaxThreads));
      thread_flags.push_back(arg);
    } else throw std::invalid_argument("unknown argument " + arg);
    ++i;
  }
  if (o.threads.empty()) {
    if (!thread_flags.empty()) throw std::invalid_argument(thread_flags.front() + " needs --threads");
    return o;
  }
  if (cuda_pairs_given)
    throw std::invalid_argument("--cuda-pairs does not apply with --threads (no cudaMalloc subject)");
  if (!pairs_given) o.pairs = kThreadPairs;
  if (!runs_given) o.runs = kThreadRuns;
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
  cached.push_back(torch_subject(native_allocator(devices), stream, sizes, o.pairs));
  cached.push_back(torch_subject(gpumem_allocator(devices), stream, sizes, o.pairs));
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
  write_file(o.out, text);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    return o.threads.empty() ? run(o) : run_threads(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allocators: %s\n", e.what());
    return 1;
  }
}
