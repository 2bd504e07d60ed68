// A private pool with a segment source of its own (torch.cuda.MemPool(allocator)): its segments
// come from that source and go back to it, each exactly once, and count against the cap like any
// other. The FakeSource's ledger is the witness; the SimBackend's shows the device is not asked.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "env_settings.h"
#include "fake_source.h"
#include "helpers.h"

using namespace gpumem_test;

namespace {

const PoolId kPool{0, 1};

StreamFilter only(StreamId stream) {
  return [stream](StreamId s) { return s == stream; };
}

// A simulated device whose allocator has one MemPool-like pool, kPool, with a FakeSource, and
// routes kStream1 to it while `routed` is set (end_routing stops it).
struct SourceSim : Sim {
  std::shared_ptr<FakeSource> source;
  bool routed = true;

  explicit SourceSim(std::optional<std::size_t> limit = std::nullopt, std::size_t source_capacity = std::size_t{1} << 40)
      : Sim(limit), source(std::make_shared<FakeSource>(source_capacity)) {
    alloc.create_pool(kPool, source);
    alloc.begin_allocate_to_pool(kPool, only(kStream1));
  }
  Block* in_pool(std::size_t size) { return malloc(size, kStream1); }
  void end_routing() {
    if (routed) alloc.end_allocate_to_pool(kPool);
    routed = false;
  }
  bool from_source(const Block* block) const { return source->owns(block->addr); }
};

}  // namespace

TEST_CASE("a pool with a source of its own takes its segments from that source", "[pools][source]") {
  SourceSim sim;
  Block* b = sim.in_pool(4096);
  REQUIRE(sim.from_source(b));
  REQUIRE(sim.segment_of(b).pool == kPool);
  REQUIRE(sim.source->reserves == 1);
  REQUIRE(sim.ledger().reserves == 0);
  REQUIRE(sim.stats().num_device_alloc == 1);  // a segment like any other in the statistics
  REQUIRE(sim.stats().reserved_bytes[kAll].current == static_cast<std::int64_t>(kSmallSegment));
}

TEST_CASE("requests outside the pool still come from the device", "[pools][source]") {
  SourceSim sim;
  Block* b = sim.malloc(4096, kStream2);
  REQUIRE_FALSE(sim.from_source(b));
  REQUIRE(sim.source->reserve_calls == 0);
  REQUIRE(sim.ledger().reserves == 1);
}

TEST_CASE("a source is asked for the usual segment sizes", "[pools][source]") {
  SourceSim sim;
  sim.in_pool(12 * MiB + 1);  // its own segment, rounded to 2 MiB
  sim.in_pool(3 * MiB);       // a 20 MiB one
  sim.in_pool(4096);          // a small one
  REQUIRE(sim.source->in_use == kSmallSegment + kMidSegment + 14 * MiB);
}

TEST_CASE("a block freed into a source pool stays cached there and is reused", "[pools][source]") {
  SourceSim sim;
  Block* a = sim.in_pool(12 * MiB);
  const std::uintptr_t addr = a->addr;
  sim.free(a);
  REQUIRE(sim.source->releases == 0);
  REQUIRE(sim.in_pool(12 * MiB)->addr == addr);
  REQUIRE(sim.source->reserves == 1);
}

TEST_CASE("a source pool uses plain segments where the device maps pages", "[pools][source][growable]") {
  SimBackend backend(kDeviceBytes);
  backend.enable_virtual_memory(2 * MiB);
  DeviceAllocator alloc(backend, 0, AllocatorConfig{});
  auto source = std::make_shared<FakeSource>();
  alloc.create_pool(kPool, source);
  alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* pooled = alloc.malloc(4 * MiB, kStream1);
  Block* plain = alloc.malloc(4 * MiB, kStream2);
  alloc.check_invariants();
  REQUIRE_FALSE(pooled->segment->growable);
  REQUIRE(source->owns(pooled->addr));
  REQUIRE(plain->segment->growable);  // the default pool keeps growable segments
  alloc.end_allocate_to_pool(kPool);
}

// ---- the cap ----

TEST_CASE("a source pool's cached segments count against the cap", "[pools][source][cap][oom]") {
  SourceSim sim(20 * MiB);
  sim.free(sim.in_pool(12 * MiB));
  REQUIRE(sim.alloc.reserved() == 12 * MiB);
  const Oom oom = oom_from([&] { sim.malloc(12 * MiB, kStream2); });  // the pool is held: its cache stays
  REQUIRE(oom.info.kind == OomKind::kFragmentation);
  REQUIRE(oom.info.reserved == 12 * MiB);
  REQUIRE(sim.ledger().reserves == 0);
  REQUIRE(sim.source->in_use == 12 * MiB);
}

TEST_CASE("the cap refuses before the source is asked", "[pools][source][cap][oom]") {
  SourceSim sim(20 * MiB);
  sim.in_pool(4096);
  REQUIRE(sim.source->reserve_calls == 1);
  REQUIRE_THROWS_AS(sim.in_pool(19 * MiB), OutOfMemoryError);  // under the limit, but its 20 MiB segment is not
  REQUIRE(sim.source->reserve_calls == 1);
  REQUIRE(sim.alloc.reserved() == kSmallSegment);
}

TEST_CASE("a request from a source pool fills the cap to the byte", "[pools][source][cap]") {
  SourceSim sim(14 * MiB);
  sim.in_pool(12 * MiB);
  sim.in_pool(4096);  // the small segment: 2 MiB, exactly the rest
  REQUIRE(sim.alloc.reserved() == 14 * MiB);
  REQUIRE(sim.source->in_use == 14 * MiB);
}

TEST_CASE("a source that has no memory fails the request as the device full and the cap is given back",
          "[pools][source][cap][oom]") {
  SourceSim sim(1 * GiB, 8 * MiB);
  const Oom oom = oom_from([&] { sim.in_pool(12 * MiB); });
  REQUIRE(oom.info.kind == OomKind::kDeviceFull);
  REQUIRE(sim.alloc.reserved() == 0);
  REQUIRE(sim.source->in_use == 0);
  REQUIRE(sim.ledger().reserves == 0);  // the device is not asked instead
  sim.alloc.check_invariants();
}

TEST_CASE("a source that refuses the normal segment is asked for the tight one, the cap exact", "[pools][source][cap]") {
  SourceSim sim;
  sim.source->refuse_next = 1;
  Block* b = sim.in_pool(3 * MiB);  // 20 MiB refused, then 4 MiB
  REQUIRE(b->segment->size == 4 * MiB);
  REQUIRE(sim.alloc.reserved() == 4 * MiB);
  REQUIRE(sim.source->in_use == 4 * MiB);
}

TEST_CASE("a source that throws passes its error on and the cap is rolled back", "[pools][source][cap]") {
  SourceSim sim(100 * MiB);
  sim.in_pool(4096);
  sim.source->throw_next = 1;
  REQUIRE_THROWS_AS(sim.in_pool(12 * MiB), SourceError);
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == kSmallSegment);
  REQUIRE(sim.in_pool(12 * MiB)->size == 12 * MiB);  // the next request works
  REQUIRE(sim.alloc.reserved() == kSmallSegment + 12 * MiB);
}

TEST_CASE("a source pool held by nobody makes way at the cap, its segment going back to the source",
          "[pools][source][cap]") {
  SourceSim sim(20 * MiB);
  sim.free(sim.in_pool(12 * MiB));
  sim.end_routing();
  sim.alloc.release_pool(kPool);
  Block* b = sim.malloc(20 * MiB, kStream2);
  REQUIRE(b->size == 20 * MiB);
  REQUIRE(sim.source->releases == 1);
  REQUIRE(sim.source->in_use == 0);
  REQUIRE(sim.ledger().in_use == 20 * MiB);
}

// ---- giving segments back ----

TEST_CASE("empty_cache gives an unheld source pool's segments back to the source, not the device",
          "[pools][source][empty_cache]") {
  SourceSim sim;
  sim.free(sim.in_pool(12 * MiB));
  sim.free(sim.in_pool(4096));
  sim.end_routing();
  sim.alloc.release_pool(kPool);
  REQUIRE(sim.source->in_use == 14 * MiB);  // releasing the pool alone keeps its cache, as native
  sim.alloc.empty_cache();
  REQUIRE(sim.source->in_use == 0);
  REQUIRE(sim.source->releases == 2);
  REQUIRE(sim.ledger().releases == 0);
  REQUIRE(sim.alloc.reserved() == 0);
  REQUIRE(sim.stats().num_device_free == 2);
}

TEST_CASE("empty_cache of a held source pool keeps its segments", "[pools][source][empty_cache]") {
  SourceSim sim;
  sim.free(sim.in_pool(12 * MiB));
  sim.end_routing();
  sim.alloc.empty_cache();
  sim.alloc.empty_cache(kPool);
  REQUIRE(sim.source->in_use == 12 * MiB);
}

TEST_CASE("the pool drops its source once its last segment went back", "[pools][source][empty_cache]") {
  SourceSim sim;
  std::weak_ptr<FakeSource> watch = sim.source;
  Block* live = sim.in_pool(12 * MiB);
  sim.end_routing();
  sim.alloc.release_pool(kPool);
  sim.source.reset();
  sim.alloc.empty_cache(kPool);
  REQUIRE_FALSE(watch.expired());  // a live block keeps its segment, and so the source
  sim.free(live);
  sim.alloc.empty_cache(kPool);
  REQUIRE(watch.expired());
  REQUIRE(sim.alloc.reserved() == 0);
}

TEST_CASE("a source whose release throws leaves the segment cached and the allocator as it was",
          "[pools][source][empty_cache]") {
  struct BrokenRelease final : SegmentSource {
    FakeSource inner;
    bool broken = true;
    void* reserve(std::size_t bytes) override { return inner.reserve(bytes); }
    void release(void* ptr, std::size_t bytes) override {
      if (broken) throw SourceError();
      inner.release(ptr, bytes);
    }
  };
  Sim sim;
  auto source = std::make_shared<BrokenRelease>();
  sim.alloc.create_pool(kPool, source);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  sim.free(sim.malloc(12 * MiB, kStream1));
  sim.alloc.end_allocate_to_pool(kPool);
  sim.alloc.release_pool(kPool);
  REQUIRE_THROWS_AS(sim.alloc.empty_cache(kPool), SourceError);
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == 12 * MiB);
  source->broken = false;
  sim.alloc.empty_cache(kPool);
  REQUIRE(source->inner.in_use == 0);
  REQUIRE(sim.alloc.reserved() == 0);
}

TEST_CASE("destroying the allocator gives a source pool's segments back to the source, live ones included",
          "[pools][source]") {
  auto source = std::make_shared<FakeSource>();
  {
    Sim sim;
    sim.alloc.create_pool(kPool, source);
    sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
    sim.malloc(12 * MiB, kStream1);
    sim.free(sim.malloc(4096, kStream1));
    REQUIRE(source->in_use == 14 * MiB);
  }
  REQUIRE(source->in_use == 0);
  REQUIRE(source->releases == 2);
}

// ---- creating ----

TEST_CASE("a source for a pool that exists already is refused and changes nothing", "[pools][source]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  auto source = std::make_shared<FakeSource>();
  REQUIRE_THROWS_AS(sim.alloc.create_pool(kPool, source), std::invalid_argument);
  REQUIRE_THROWS_WITH(sim.alloc.create_pool(kPool, source), Catch::Contains("exists already"));
  REQUIRE(sim.alloc.pool_use_count(kPool) == 1);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  REQUIRE_FALSE(source->owns(sim.malloc(4096, kStream1)->addr));
  sim.alloc.end_allocate_to_pool(kPool);
}

TEST_CASE("increfing a source pool without a source keeps its source", "[pools][source]") {
  SourceSim sim;
  sim.alloc.create_pool(kPool);
  REQUIRE(sim.alloc.pool_use_count(kPool) == 2);
  REQUIRE(sim.from_source(sim.in_pool(4096)));
}

// ---- random operations ----

namespace {

// Bytes of the snapshot's segments in `pool`.
std::size_t pool_bytes(const std::vector<SegmentInfo>& snapshot, PoolId pool) {
  std::size_t bytes = 0;
  for (const SegmentInfo& s : snapshot) {
    if (s.pool == pool) bytes += s.size;
  }
  return bytes;
}

// Seeded random mallocs and frees in the default pool and a use_on_oom source pool (no_split or
// not) under a 64 MiB cap, with a source smaller than that which sometimes throws, empty_cache of
// either id, the pool's holder and its target coming and going (an unheld pool may be erased and
// made again with the same source). After every operation: the invariants, and the cap held to
// the byte against the two ledgers the allocator does not keep.
// What a run met: the source threw, refused, and a default-pool request got a block of the pool.
struct Tally {
  int thrown = 0;
  std::uint64_t refused = 0;
  int borrowed = 0;
};

Tally run_random(std::uint64_t seed, bool no_split, std::uint64_t ops) {
  constexpr std::size_t kLimit = 64 * MiB;
  std::mt19937_64 rng(seed);
  Sim sim(kLimit);
  auto source = std::make_shared<FakeSource>(32 * MiB);
  const auto hold = [&] {
    try {
      sim.alloc.create_pool(kPool, source);
    } catch (const std::invalid_argument&) {
      sim.alloc.create_pool(kPool);  // still there, with its source
    }
    sim.alloc.set_pool_option(kPool, PoolOption::kUseOnOom, true);
    if (no_split) sim.alloc.set_pool_option(kPool, PoolOption::kNoSplit, true);
  };
  hold();
  bool held = true, routed = false;
  std::vector<Block*> live;
  Tally tally;
  const auto log_uniform = [&](double lo, double hi) {
    return static_cast<std::size_t>(std::exp(std::uniform_real_distribution<double>(std::log(lo), std::log(hi))(rng)));
  };
  for (std::uint64_t i = 0; i < ops; ++i) {
    INFO("seed " << seed << ", operation " << i);
    const auto r = rng() % 100;
    if (r < 45 && live.size() < 48) {
      source->throw_next = rng() % 8 == 0 ? 1 : 0;
      source->refuse_next = rng() % 8 == 0 ? 1 : 0;
      const StreamId stream = rng() % 2 ? kStream1 : kStream2;
      try {
        live.push_back(sim.alloc.malloc(log_uniform(512, 16.0 * MiB), stream));
        const bool to_pool = routed && stream == kStream1;
        if (!to_pool && live.back()->segment->pool->id() == kPool) {
          REQUIRE(held);  // a released pool lends nothing
          ++tally.borrowed;
        }
      } catch (const OutOfMemoryError&) {
      } catch (const SourceError&) {
        ++tally.thrown;
      }
      source->throw_next = source->refuse_next = 0;
    } else if (r < 90 && !live.empty()) {
      const std::size_t k = rng() % live.size();
      sim.alloc.free(live[k]);
      live[k] = live.back();
      live.pop_back();
    } else if (r < 94) {
      sim.alloc.empty_cache(rng() % 2 ? kPool : PoolId{});
    } else if (r < 97) {
      if (held) {
        sim.alloc.release_pool(kPool);
      } else {
        hold();
      }
      held = !held;
    } else if (routed) {
      sim.alloc.end_allocate_to_pool(kPool);
      routed = false;
    } else if (held) {
      sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
      routed = true;
    }
    sim.alloc.check_invariants();
    REQUIRE(sim.alloc.reserved() == sim.ledger().in_use + source->in_use);
    REQUIRE(sim.alloc.reserved() <= kLimit);
    REQUIRE(source->in_use == pool_bytes(sim.snapshot(), kPool));
  }
  for (Block* b : live) sim.alloc.free(b);
  if (routed) sim.alloc.end_allocate_to_pool(kPool);
  if (held) sim.alloc.release_pool(kPool);
  sim.alloc.empty_cache();
  REQUIRE(source->in_use == 0);
  REQUIRE(sim.ledger().in_use == 0);
  REQUIRE(source->reserves == source->releases);
  tally.refused = source->refusals;
  return tally;
}

}  // namespace

TEST_CASE("random requests across a source pool and the default pool hold the cap to the byte",
          "[pools][source][property]") {
  const std::uint64_t ops = std::max<std::uint64_t>(env_number("GPUMEM_PROPERTY_OPS", 1000000) / 100, 2000);
  const std::uint64_t seed = env_number("GPUMEM_PROPERTY_SEED", 20250);
  Tally total;
  for (std::uint64_t run = 0; run < 4; ++run) {
    const Tally t = run_random(seed + run, run % 2 == 1, ops);
    total.thrown += t.thrown;
    total.refused += t.refused;
    total.borrowed += t.borrowed;
  }
  // The runs met what they are for.
  REQUIRE(total.thrown > 0);
  REQUIRE(total.refused > 0);
  REQUIRE(total.borrowed > 0);
}
