// The hard cap (cap.h) at its edges, changing the limit at run time, and the release threshold.
// What was reserved is read from the SimBackend's ledger, which the allocator cannot fudge.
#include <atomic>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include "helpers.h"

using namespace gpumem_test;

namespace {

// A device whose driver can break: reserve throws instead of refusing.
class BreakingBackend : public SimBackend {
 public:
  using SimBackend::SimBackend;
  bool break_next = false;

  void* reserve(int device, std::size_t bytes) override {
    if (break_next) {
      break_next = false;
      throw std::runtime_error("simulated driver failure");
    }
    return SimBackend::reserve(device, bytes);
  }
};

int count_on_stream(const std::vector<SegmentInfo>& snapshot, StreamId stream) {
  int n = 0;
  for (const SegmentInfo& s : snapshot) n += s.stream == stream ? 1 : 0;
  return n;
}

}  // namespace

// ---- the cap at its edges ---------------------------------------------------------------------

TEST_CASE("a limit exactly equal to the segment needed succeeds", "[cap]") {
  Sim sim(10 * MiB);
  Block* b = sim.malloc(10 * MiB);
  REQUIRE(b->size == 10 * MiB);
  REQUIRE(sim.ledger().in_use == 10 * MiB);
  REQUIRE(sim.ledger().peak == 10 * MiB);
}

TEST_CASE("a limit one byte below the request is over the limit", "[cap][oom]") {
  Sim sim(10 * MiB - 1);
  const Oom oom = oom_from([&] { sim.malloc(10 * MiB); });
  REQUIRE(oom.info.kind == OomKind::kOverLimit);
  REQUIRE(oom.info.limit == 10 * MiB - 1);
  REQUIRE(sim.ledger().reserves == 0);
  REQUIRE(sim.ledger().refusals == 0);  // the device was never asked
  REQUIRE(sim.alloc.reserved() == 0);
}

TEST_CASE("a limit one byte below the smallest segment for a request that fits is fragmentation", "[cap][oom]") {
  SECTION("a large request") {
    Sim sim(4 * MiB - 1);  // 3 MiB fits under it, but the smallest segment for 3 MiB is 4 MiB
    const Oom oom = oom_from([&] { sim.malloc(3 * MiB); });
    REQUIRE(oom.info.kind == OomKind::kFragmentation);
    REQUIRE(sim.ledger().reserves == 0);
  }
  SECTION("a small request") {
    Sim sim(2 * MiB - 1);
    const Oom oom = oom_from([&] { sim.malloc(512); });
    REQUIRE(oom.info.kind == OomKind::kFragmentation);
    REQUIRE(sim.ledger().reserves == 0);
  }
}

TEST_CASE("allocations filling the limit exactly succeed and one byte more fails", "[cap][oom]") {
  Sim sim(60 * MiB);
  for (int i = 0; i < 3; ++i) sim.malloc(20 * MiB);
  REQUIRE(sim.ledger().in_use == 60 * MiB);
  const Oom oom = oom_from([&] { sim.malloc(1); });
  REQUIRE(oom.info.kind == OomKind::kOverLimit);
  REQUIRE(oom.info.allocated == 60 * MiB);
  REQUIRE(sim.ledger().peak == 60 * MiB);
}

TEST_CASE("the bytes of a refused segment are given back to the cap", "[cap][oom]") {
  Sim sim(20 * MiB);
  sim.backend.fail_next(2);
  oom_from([&] { sim.malloc(20 * MiB); });
  REQUIRE(sim.alloc.reserved() == 0);
  REQUIRE(sim.malloc(20 * MiB)->size == 20 * MiB);  // all 20 MiB of headroom are there again
  REQUIRE(sim.ledger().in_use == 20 * MiB);
}

TEST_CASE("a request near SIZE_MAX fails over the limit", "[cap][oom]") {
  // Rounding the request, adding it to what is allocated, and rounding the segment must not wrap
  // around: a request beyond the limit is over the limit whatever its size.
  const std::size_t requested = GENERATE(std::numeric_limits<std::size_t>::max(),
                                         std::numeric_limits<std::size_t>::max() - 1024,
                                         std::numeric_limits<std::size_t>::max() - 2 * MiB,
                                         std::numeric_limits<std::size_t>::max() / 2 + 1);
  Sim sim(64 * MiB);
  sim.malloc(4096);  // something allocated, so allocated + request can wrap
  const SimBackend::Ledger before = sim.ledger();
  INFO("requested " << requested);
  std::string what;
  bool over_limit = false;
  try {
    sim.alloc.malloc(requested, kStream0);
    what = "a block was handed out";
  } catch (const OutOfMemoryError& e) {
    over_limit = e.info().kind == OomKind::kOverLimit;
    what = e.what();
  } catch (const std::exception& e) {
    what = std::string("another error: ") + e.what();
  }
  INFO(what);
  REQUIRE(over_limit);
  REQUIRE(sim.ledger().reserves == before.reserves);
  sim.alloc.check_invariants();
}

TEST_CASE("a backend that throws leaves the cap and the statistics unchanged", "[cap]") {
  BreakingBackend backend(kDeviceBytes);
  DeviceAllocator alloc(backend, 0, config_with(20 * MiB));
  backend.break_next = true;
  REQUIRE_THROWS_AS(alloc.malloc(20 * MiB, kStream0), std::runtime_error);
  REQUIRE(alloc.reserved() == 0);
  REQUIRE(alloc.stats().reserved_bytes[kAll].current == 0);
  REQUIRE(alloc.stats().num_device_alloc == 0);
  alloc.check_invariants();
  REQUIRE(alloc.malloc(20 * MiB, kStream0)->size == 20 * MiB);
  REQUIRE(backend.ledger(0).in_use == 20 * MiB);
}

TEST_CASE("reserved never passes the limit under a random workload", "[cap]") {
  const bool device_fails = GENERATE(false, true);
  constexpr std::size_t kLimit = 64 * MiB;
  Sim sim(kLimit);
  if (device_fails) sim.backend.fail_randomly(0.05, 7);
  std::mt19937 rng(20240601);
  const std::size_t sizes[] = {1, 500, 4096, 100 * KiB, MiB, MiB + 1, 3 * MiB, 9 * MiB, 10 * MiB, 15 * MiB, 30 * MiB};
  std::vector<Block*> live;
  int served = 0, ooms = 0, ledger_disagreements = 0;
  for (int i = 0; i < 4000; ++i) {
    const unsigned op = rng() % 10;
    if (op < 6 || live.empty()) {
      const std::size_t size = sizes[rng() % (sizeof sizes / sizeof sizes[0])];
      const StreamId stream = rng() % 3;
      try {
        Block* b = sim.alloc.malloc(size, stream);
        live.push_back(b);
        ++served;
        if (rng() % 4 == 0) sim.alloc.record_stream(b, (stream + 1) % 3);
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
    } else if (op < 9) {
      const std::size_t i_live = rng() % live.size();
      sim.alloc.free(live[i_live]);
      live[i_live] = live.back();
      live.pop_back();
    } else if (rng() % 2 == 0) {
      sim.backend.complete_events();
    } else {
      sim.alloc.empty_cache();
    }
    sim.alloc.check_invariants();
    if (sim.ledger().in_use != sim.alloc.reserved()) ++ledger_disagreements;
  }
  INFO("served " << served << ", out of memory " << ooms);
  REQUIRE(served > 1000);
  REQUIRE(ooms > 0);
  REQUIRE(ledger_disagreements == 0);
  REQUIRE(sim.ledger().peak <= kLimit);
}

TEST_CASE("reserved never passes the limit with threads allocating at once", "[cap]") {
  constexpr std::size_t kLimit = 48 * MiB;
  Sim sim(kLimit);
  const std::size_t sizes[] = {512, 4096, 200 * KiB, MiB, 3 * MiB, 12 * MiB};
  std::atomic<int> served{0}, ooms{0}, other_errors{0};
  const auto worker = [&](unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<Block*> live;
    const auto free_one = [&] {
      const std::size_t i = rng() % live.size();
      try {
        sim.alloc.free(live[i]);
      } catch (...) {
        ++other_errors;
      }
      live[i] = live.back();
      live.pop_back();
    };
    for (int i = 0; i < 2000; ++i) {
      if (!live.empty() && rng() % 3 == 0) {
        free_one();
        continue;
      }
      try {
        live.push_back(sim.alloc.malloc(sizes[rng() % (sizeof sizes / sizeof sizes[0])], rng() % 2));
        ++served;
      } catch (const OutOfMemoryError&) {
        ++ooms;
      } catch (...) {
        ++other_errors;
      }
    }
    while (!live.empty()) free_one();
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t) threads.emplace_back(worker, 1000 + t);
  for (std::thread& t : threads) t.join();

  sim.alloc.check_invariants();
  INFO("served " << served << ", out of memory " << ooms);
  REQUIRE(other_errors == 0);
  REQUIRE(served > 0);
  REQUIRE(ooms > 0);
  REQUIRE(sim.ledger().peak <= kLimit);
  REQUIRE(sim.stats().allocated_bytes[kAll].current == 0);
  REQUIRE(sim.ledger().in_use == sim.alloc.reserved());
}

// ---- set_limit --------------------------------------------------------------------------------

TEST_CASE("raising the limit takes effect at once", "[limit]") {
  Sim sim(20 * MiB);
  sim.malloc(20 * MiB);
  REQUIRE(oom_from([&] { sim.malloc(2 * MiB); }).info.kind == OomKind::kOverLimit);
  sim.alloc.set_limit(std::optional<std::size_t>(40 * MiB));
  REQUIRE(sim.alloc.limit() == 40 * MiB);
  sim.malloc(2 * MiB);
  REQUIRE(sim.ledger().in_use == 40 * MiB);
}

TEST_CASE("lowering the limit releases the oldest cached segments down to it", "[limit]") {
  Sim sim(100 * MiB);
  Block* oldest = sim.malloc(20 * MiB);
  Block* live = sim.malloc(20 * MiB);
  Block* middle = sim.malloc(20 * MiB);
  Block* newest = sim.malloc(20 * MiB);
  const std::uintptr_t oldest_addr = oldest->addr, middle_addr = middle->addr, newest_addr = newest->addr;
  sim.free(oldest);
  sim.free(middle);
  sim.free(newest);

  sim.alloc.set_limit(std::optional<std::size_t>(50 * MiB));
  sim.alloc.check_invariants();
  REQUIRE(sim.ledger().in_use == 40 * MiB);
  REQUIRE(sim.ledger().releases == 2);
  REQUIRE_FALSE(sim.has_segment_at(oldest_addr));
  REQUIRE_FALSE(sim.has_segment_at(middle_addr));
  REQUIRE(sim.has_segment_at(newest_addr));
  REQUIRE(sim.has_segment_at(live->addr));
  REQUIRE(sim.stats().num_cache_releases == 1);
}

TEST_CASE("lowering the limit below what is allocated never touches live blocks", "[limit]") {
  Sim sim(100 * MiB);
  Block* a = sim.malloc(30 * MiB);
  Block* b = sim.malloc(4096);
  Block* cached = sim.malloc(20 * MiB);
  sim.free(cached);

  sim.alloc.set_limit(std::optional<std::size_t>(10 * MiB));
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.limit() == 10 * MiB);
  REQUIRE(sim.ledger().in_use == 32 * MiB);  // the cached 20 MiB went; the live segments stayed
  REQUIRE(sim.alloc.reserved() == 32 * MiB);
  REQUIRE(sim.segment_of(a).blocks[0].state == BlockInfo::kAllocated);
  REQUIRE(sim.segment_of(b).blocks[0].state == BlockInfo::kAllocated);
  REQUIRE(sim.stats().allocated_bytes[kAll].current == static_cast<std::int64_t>(30 * MiB + 4096));
}

TEST_CASE("while allocated is above a lowered limit growth fails and freeing works", "[limit][oom]") {
  Sim sim(100 * MiB);
  Block* a = sim.malloc(30 * MiB);
  Block* b = sim.malloc(30 * MiB);
  sim.alloc.set_limit(std::optional<std::size_t>(40 * MiB));
  REQUIRE(sim.ledger().in_use == 60 * MiB);

  const Oom oom = oom_from([&] { sim.malloc(512); });
  REQUIRE(oom.info.kind == OomKind::kOverLimit);
  REQUIRE(oom.info.limit == 40 * MiB);
  REQUIRE(oom.info.reserved == 60 * MiB);
  REQUIRE(oom_from([&] { sim.malloc(12 * MiB, kStream1); }).info.kind == OomKind::kOverLimit);
  REQUIRE(sim.ledger().reserves == 2);

  sim.free(a);
  REQUIRE(sim.stats().allocated_bytes[kAll].current == static_cast<std::int64_t>(30 * MiB));

  // Now 8 MiB fits under the limit: the freed segment makes way for a tight one.
  Block* c = sim.malloc(8 * MiB, kStream1);
  REQUIRE(sim.segment_of(c).size == 8 * MiB);
  REQUIRE(sim.ledger().in_use == 38 * MiB);
  REQUIRE(sim.alloc.reserved() <= sim.alloc.limit());
  (void)b;
}

TEST_CASE("frees above a lowered limit give memory back until reserved is under it", "[limit]") {
  Sim sim(1000 * 1000 * 1000);
  free_everything_above_a_lowered_limit(sim);
  REQUIRE(sim.ledger().peak == 800 * MiB);
}

TEST_CASE("above a lowered limit a free keeps the cache once reserved is under the limit again", "[limit]") {
  Sim sim(100 * MiB);
  Block* a = sim.malloc(30 * MiB);
  Block* b = sim.malloc(30 * MiB);
  Block* c = sim.malloc(20 * MiB);
  sim.alloc.set_limit(std::optional<std::size_t>(50 * MiB));
  sim.free(a);  // 80 -> 50 MiB: under the limit again
  REQUIRE(sim.ledger().in_use == 50 * MiB);
  sim.free(c);  // under the limit: cached, as always
  REQUIRE(sim.ledger().in_use == 50 * MiB);
  const std::uintptr_t cached = c->addr;
  const std::uint64_t reserves = sim.ledger().reserves;
  REQUIRE(sim.malloc(20 * MiB)->addr == cached);  // served from the cache
  REQUIRE(sim.ledger().reserves == reserves);
  (void)b;
}

TEST_CASE("above a lowered limit a request during pool allocation releases what covers the overshoot",
          "[limit][pools][oom]") {
  // Frees while a pool is the allocation target keep their memory (a graph may be capturing), so
  // reserved stays above the lowered limit with segments cached. The deficit a new segment faces is
  // then reserved + segment - limit, more than the segment itself, and there is no synchronize
  // step to make up for a release that freed too little: the policy must cover all of it.
  Sim sim(200 * MiB);
  Block* live = sim.malloc(30 * MiB);
  Block* x = sim.malloc(12 * MiB);
  Block* y = sim.malloc(30 * MiB);
  sim.alloc.set_limit(std::optional<std::size_t>(50 * MiB));  // 72 MiB reserved, nothing to release
  sim.alloc.create_pool(PoolId{1, 1});
  sim.alloc.begin_allocate_to_pool(PoolId{1, 1}, [](StreamId s) { return s == kStream3; });
  sim.free(x);
  sim.free(y);
  REQUIRE(sim.ledger().in_use == 72 * MiB);

  // 8 MiB on another stream: allocated 38 MiB fits, the deficit is 72 + 8 - 50 = 30 MiB, which
  // only y covers. x (12 MiB) stays cached.
  Block* b = nullptr;
  REQUIRE_NOTHROW(b = sim.alloc.malloc(8 * MiB, kStream1));
  sim.alloc.check_invariants();
  REQUIRE(b->size == 8 * MiB);
  REQUIRE(sim.ledger().releases == 1);
  REQUIRE(sim.ledger().in_use == 50 * MiB);
  sim.alloc.end_allocate_to_pool(PoolId{1, 1});
  (void)live;
}

TEST_CASE("frees during pool allocation above a lowered limit give memory back when it ends", "[limit][pools]") {
  Sim sim(200 * MiB);
  Block* live = sim.malloc(30 * MiB);
  Block* x = sim.malloc(30 * MiB);
  sim.alloc.set_limit(std::optional<std::size_t>(40 * MiB));
  sim.alloc.create_pool(PoolId{1, 1});
  sim.alloc.begin_allocate_to_pool(PoolId{1, 1}, [](StreamId s) { return s == kStream3; });
  sim.free(x);
  REQUIRE(sim.ledger().in_use == 60 * MiB);  // kept while the pool is the target
  sim.alloc.end_allocate_to_pool(PoolId{1, 1});
  sim.alloc.check_invariants();
  REQUIRE(sim.ledger().in_use == 30 * MiB);
  (void)live;
}

TEST_CASE("lowering the limit releases a segment whose stream use has ended", "[limit][streams]") {
  Sim sim(100 * MiB);
  Block* a = sim.malloc(30 * MiB);
  sim.alloc.record_stream(a, kStream1);
  sim.free(a);
  sim.backend.complete_events();
  sim.alloc.set_limit(std::optional<std::size_t>(20 * MiB));
  sim.alloc.check_invariants();
  REQUIRE(sim.ledger().in_use == 0);
  REQUIRE(sim.ledger().live_events == 0);
}

TEST_CASE("no limit means the device total", "[limit]") {
  Sim sim(16 * MiB, 64 * MiB);
  REQUIRE(sim.alloc.limit() == 16 * MiB);
  SECTION("nullopt") { sim.alloc.set_limit(std::optional<std::size_t>()); }
  SECTION("the spec none") { sim.alloc.set_limit("none"); }
  REQUIRE(sim.alloc.limit() == 64 * MiB);
  Sim unlimited(std::nullopt, 64 * MiB);
  REQUIRE(unlimited.alloc.limit() == 64 * MiB);
}

TEST_CASE("a limit spec sets the limit in bytes", "[limit]") {
  Sim sim(std::nullopt, GiB);
  sim.alloc.set_limit("64MB");
  REQUIRE(sim.alloc.limit() == 64 * MiB);
  sim.alloc.set_limit("25%");
  REQUIRE(sim.alloc.limit() == 256 * MiB);
  sim.alloc.set_limit("0.5");
  REQUIRE(sim.alloc.limit() == 512 * MiB);
}

TEST_CASE("a limit above the device total is rejected and the limit unchanged", "[limit]") {
  Sim sim(16 * MiB, 64 * MiB);
  REQUIRE_THROWS_AS(sim.alloc.set_limit(std::optional<std::size_t>(64 * MiB + 1)), LimitSpecError);
  REQUIRE(sim.alloc.limit() == 16 * MiB);
  REQUIRE_THROWS_AS(sim.alloc.set_limit("65MB"), LimitSpecError);
  REQUIRE(sim.alloc.limit() == 16 * MiB);
  sim.alloc.set_limit(std::optional<std::size_t>(64 * MiB));  // the total itself is fine
  REQUIRE(sim.alloc.limit() == 64 * MiB);
}

TEST_CASE("a bad limit spec is rejected and the limit unchanged", "[limit]") {
  Sim sim(16 * MiB, 64 * MiB);
  REQUIRE_THROWS_AS(sim.alloc.set_limit("4XB"), LimitSpecError);
  REQUIRE_THROWS_WITH(sim.alloc.set_limit("4XB"), Catch::Contains("4XB"));
  REQUIRE_THROWS_AS(sim.alloc.set_limit(""), LimitSpecError);
  REQUIRE_THROWS_AS(sim.alloc.set_limit("-1GB"), LimitSpecError);
  REQUIRE(sim.alloc.limit() == 16 * MiB);
}

TEST_CASE("a configured limit above the device total is rejected", "[limit]") {
  SimBackend backend(64 * MiB);
  REQUIRE_THROWS_AS(DeviceAllocator(backend, 0, config_with(64 * MiB + 1)), LimitSpecError);
  REQUIRE_THROWS_WITH(DeviceAllocator(backend, 0, config_with(64 * MiB + 1)), Catch::Contains("above device 0"));
}

TEST_CASE("a rejected config asks the device for its total and nothing else", "[limit]") {
  // Asking more of a CUDA device (its mapping granularity) before the config is known to hold
  // would be work, and driver calls, for an allocator that is never made.
  CountingBackend backend(64 * MiB);
  backend.enable_virtual_memory(2 * MiB);
  REQUIRE_THROWS_AS(DeviceAllocator(backend, 0, config_with(64 * MiB + 1)), LimitSpecError);
  REQUIRE(backend.totals == 1);  // a limit is checked against the total
  REQUIRE_THROWS_AS(DeviceAllocator(backend, 0, config_with(16 * MiB, 2.0)), LimitSpecError);
  REQUIRE(backend.totals == 1);  // a bad release threshold needs nothing from the device
  REQUIRE(backend.asked() == backend.totals);
  DeviceAllocator alloc(backend, 0, config_with(16 * MiB));
  REQUIRE(backend.page_sizes == 1);
  REQUIRE(alloc.page_size() == 2 * MiB);
}

// ---- the release threshold --------------------------------------------------------------------

TEST_CASE("with a release threshold a free above it releases the oldest unused segments down to it", "[cap]") {
  Sim sim(100 * MiB, kDeviceBytes, 0.5);
  Block* a = sim.malloc(20 * MiB, kStream0);
  Block* b = sim.malloc(20 * MiB, kStream0);
  Block* c = sim.malloc(20 * MiB, kStream1);  // 60 MiB reserved, past the 50 MiB threshold, all live
  REQUIRE(sim.ledger().in_use == 60 * MiB);
  REQUIRE(sim.ledger().releases == 0);

  sim.free(b);  // b's segment is unused and reserved is above the threshold: it goes
  REQUIRE(sim.ledger().in_use == 40 * MiB);
  REQUIRE(sim.ledger().releases == 1);
  REQUIRE(sim.stats().num_cache_releases == 1);

  sim.free(a);  // 40 MiB reserved is under the threshold: a's segment stays cached
  REQUIRE(sim.ledger().in_use == 40 * MiB);
  REQUIRE(count_on_stream(sim.snapshot(), kStream0) == 1);
  (void)c;
}

TEST_CASE("with a release threshold a new segment past it releases the oldest unused segments", "[cap]") {
  Sim sim(100 * MiB, kDeviceBytes, 0.5);
  Block* a = sim.malloc(20 * MiB, kStream0);
  Block* b = sim.malloc(20 * MiB, kStream0);
  sim.free(a);
  sim.free(b);  // 40 MiB reserved: under the 50 MiB threshold, both stay cached
  REQUIRE(sim.ledger().releases == 0);
  sim.malloc(20 * MiB, kStream1);  // 60 MiB: a, the oldest unused, goes
  REQUIRE(sim.ledger().in_use == 40 * MiB);
  sim.malloc(20 * MiB, kStream1);  // 60 MiB again: b goes
  REQUIRE(sim.ledger().in_use == 40 * MiB);
  REQUIRE(sim.ledger().releases == 2);
  REQUIRE(count_on_stream(sim.snapshot(), kStream0) == 0);
}

TEST_CASE("the release threshold never releases segments with live blocks", "[cap]") {
  Sim sim(100 * MiB, kDeviceBytes, 0.25);
  Block* a = sim.malloc(20 * MiB);
  Block* b = sim.malloc(20 * MiB);
  Block* c = sim.malloc(4 * MiB);  // shares a 20 MiB segment with nothing else
  sim.free(c);
  REQUIRE(sim.ledger().in_use == 40 * MiB);  // only c's segment could go
  REQUIRE(sim.ledger().releases == 1);
  (void)a, (void)b;
}

TEST_CASE("setting a release threshold applies it at once", "[cap]") {
  Sim sim(100 * MiB);
  Block* blocks[5];
  for (Block*& b : blocks) b = sim.malloc(20 * MiB);
  const std::uintptr_t first = blocks[1]->addr, second = blocks[2]->addr, third = blocks[3]->addr;
  sim.free(blocks[1]);
  sim.free(blocks[2]);
  sim.free(blocks[3]);
  REQUIRE(sim.ledger().in_use == 100 * MiB);

  sim.alloc.set_release_threshold(0.7);
  REQUIRE(sim.alloc.release_threshold() == 0.7);
  REQUIRE(sim.ledger().in_use == 60 * MiB);
  REQUIRE_FALSE(sim.has_segment_at(first));
  REQUIRE_FALSE(sim.has_segment_at(second));
  REQUIRE(sim.has_segment_at(third));
}

TEST_CASE("a release threshold of 0 keeps every freed segment cached", "[cap]") {
  Sim sim(100 * MiB, kDeviceBytes, 0.5);
  sim.alloc.set_release_threshold(0.0);
  Block* blocks[4];
  for (Block*& b : blocks) b = sim.malloc(20 * MiB);
  for (Block* b : blocks) sim.free(b);
  REQUIRE(sim.ledger().in_use == 80 * MiB);
  REQUIRE(sim.ledger().releases == 0);
}

TEST_CASE("lowering the limit applies the release threshold to the new limit", "[cap][limit]") {
  Sim sim(100 * MiB, kDeviceBytes, 0.5);
  Block* a = sim.malloc(20 * MiB);
  Block* b = sim.malloc(20 * MiB);
  sim.free(a);
  sim.free(b);
  REQUIRE(sim.ledger().in_use == 40 * MiB);
  sim.alloc.set_limit(std::optional<std::size_t>(60 * MiB));  // the threshold is 30 MiB now
  REQUIRE(sim.ledger().in_use == 20 * MiB);
}

TEST_CASE("a bad release threshold is rejected and the threshold unchanged", "[cap]") {
  Sim sim(100 * MiB, kDeviceBytes, 0.5);
  REQUIRE_THROWS_AS(sim.alloc.set_release_threshold(1.5), LimitSpecError);
  REQUIRE_THROWS_AS(sim.alloc.set_release_threshold(-0.1), LimitSpecError);
  REQUIRE_THROWS_AS(sim.alloc.set_release_threshold(std::nan("")), LimitSpecError);
  REQUIRE_THROWS_AS(sim.alloc.set_release_threshold(std::numeric_limits<double>::infinity()), LimitSpecError);
  REQUIRE_THROWS_WITH(sim.alloc.set_release_threshold(1.5), Catch::Contains("release threshold"));
  REQUIRE(sim.alloc.release_threshold() == 0.5);
}

TEST_CASE("a configured bad release threshold is rejected", "[cap]") {
  SimBackend backend(kDeviceBytes);
  REQUIRE_THROWS_AS(DeviceAllocator(backend, 0, config_with(std::nullopt, 2.0)), LimitSpecError);
}
