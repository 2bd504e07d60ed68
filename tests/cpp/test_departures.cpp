// empty_cache gives plain segments back to the backend after letting go of the device
// (core/departures.h): a slow release stalls no other thread, the cap counts the departing bytes
// until they are back, and a request that needs them waits for them instead of failing.
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "helpers.h"

using namespace gpumem_test;

namespace {

using namespace std::chrono_literals;

// A simulated device whose release of a segment blocks until the test opens the gate: a cudaFree
// that takes long.
class SlowRelease : public SimBackend {
 public:
  using SimBackend::SimBackend;
  void release(int device, void* ptr, std::size_t bytes) override {
    {
      std::unique_lock<std::mutex> lock(m_);
      ++entered_;
      changed_.notify_all();
      changed_.wait(lock, [this] { return open_; });
    }
    SimBackend::release(device, ptr, bytes);
  }
  void wait_entered() {
    std::unique_lock<std::mutex> lock(m_);
    changed_.wait(lock, [this] { return entered_ > 0; });
  }
  void open() {
    const std::lock_guard<std::mutex> lock(m_);
    open_ = true;
    changed_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable changed_;
  int entered_ = 0;
  bool open_ = false;
};

// Opens the gate when the test ends, failed or not, so that no thread waits for ever.
struct Opens {
  SlowRelease& backend;
  ~Opens() { backend.open(); }
};

AllocatorConfig plain(std::optional<std::size_t> limit = std::nullopt) {
  AllocatorConfig config;
  config.limit = limit;
  config.growable = false;
  return config;
}

}  // namespace

TEST_CASE("while empty_cache gives a segment back, other threads allocate from the cache", "[departures][threads]") {
  SlowRelease backend(kDeviceBytes);
  DeviceAllocator alloc(backend, 0, plain());
  std::future<void> emptying;
  std::future<Block*> cached, fresh;
  Opens gate{backend};  // after the futures: opened first, whatever fails
  Block* live = alloc.malloc(512 * KiB, kStream0);  // a 2 MiB small segment that stays, 1.5 MiB cached
  alloc.free(alloc.malloc(64 * MiB, kStream1));     // a 64 MiB segment, free: empty_cache's
  const std::size_t reserved = alloc.reserved();
  emptying = std::async(std::launch::async, [&] { alloc.empty_cache(); });
  backend.wait_entered();
  // The device is not held: a cached call and a call that takes a new segment both go through.
  // The release stays shut until the end, so these bounds only spare a loaded machine a false failure.
  cached = std::async(std::launch::async, [&] { return alloc.malloc(512 * KiB, kStream0); });
  REQUIRE(cached.wait_for(120s) == std::future_status::ready);
  REQUIRE(alloc.reserved() == reserved);  // served from the cache; the departing 64 MiB still count
  fresh = std::async(std::launch::async, [&] { return alloc.malloc(30 * MiB, kStream0); });
  REQUIRE(fresh.wait_for(120s) == std::future_status::ready);
  REQUIRE(alloc.reserved() == reserved + 30 * MiB);
  alloc.check_invariants();
  backend.open();
  emptying.get();
  alloc.check_invariants();
  REQUIRE(alloc.reserved() == 2 * MiB + 30 * MiB);
  REQUIRE(backend.ledger(0).in_use == 2 * MiB + 30 * MiB);
  for (Block* b : {live, cached.get(), fresh.get()}) alloc.free(b);
}

// The cap (100 MiB) cached whole; while empty_cache gives it back, `request` on another thread
// waits, and is served once the memory is back, the device never holding more than the cap.
template <class Request>
auto served_after_departure(SlowRelease& backend, DeviceAllocator& alloc, Request request) {
  using Got = decltype(request());
  std::future<void> emptying;
  std::future<Got> needing;
  Opens gate{backend};
  alloc.free(alloc.malloc(100 * MiB, kStream0));
  emptying = std::async(std::launch::async, [&] { alloc.empty_cache(); });
  backend.wait_entered();
  needing = std::async(std::launch::async, request);
  REQUIRE(needing.wait_for(200ms) == std::future_status::timeout);  // waits: the cap is still full
  REQUIRE(alloc.reserved() == 100 * MiB);
  backend.open();
  emptying.get();
  Got got = needing.get();  // served once the 100 MiB are back
  REQUIRE(got != nullptr);
  REQUIRE(backend.ledger(0).peak <= 100 * MiB);
  return got;
}

TEST_CASE("a request that needs departing memory waits for it and is served, never over the cap", "[departures][threads][cap]") {
  SlowRelease backend(kDeviceBytes);
  DeviceAllocator alloc(backend, 0, plain(100 * MiB));
  Block* got = served_after_departure(backend, alloc, [&] { return alloc.malloc(60 * MiB, kStream1); });
  REQUIRE(alloc.reserved() <= 100 * MiB);
  alloc.check_invariants();
  alloc.free(got);
}

TEST_CASE("caching off: an uncached request waits for departing memory too", "[departures][threads][uncached]") {
  SlowRelease backend(kDeviceBytes);
  DeviceAllocator alloc(backend, 0, plain(100 * MiB));
  void* ptr = served_after_departure(backend, alloc, [&] { return alloc.malloc_uncached(60 * MiB); });
  REQUIRE(alloc.free_uncached(ptr));
  alloc.check_invariants();
}

TEST_CASE("with nothing departing, a request over the cap fails at once as before", "[departures][cap]") {
  SimBackend backend(kDeviceBytes);
  DeviceAllocator alloc(backend, 0, plain(100 * MiB));
  Block* held = alloc.malloc(80 * MiB, kStream0);
  REQUIRE_THROWS_AS(alloc.malloc(60 * MiB, kStream0), OutOfMemoryError);
  alloc.empty_cache();
  REQUIRE_THROWS_AS(alloc.malloc(60 * MiB, kStream0), OutOfMemoryError);
  alloc.free(held);
}
