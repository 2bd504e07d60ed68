// Private pools (CUDA graphs, MemPools): routing requests by stream while a pool is the target,
// caching per pool, and releasing a pool's cache once nothing holds it.
#include <stdexcept>

#include "helpers.h"

using namespace gpumem_test;

namespace {

const PoolId kPool{1, 1};
const PoolId kOtherPool{2, 0};

StreamFilter only(StreamId stream) {
  return [stream](StreamId s) { return s == stream; };
}

}  // namespace

TEST_CASE("requests on streams the filter accepts come from the private pool", "[pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* in_pool = sim.malloc(4096, kStream1);
  Block* in_default = sim.malloc(4096, kStream2);
  REQUIRE(sim.segment_of(in_pool).pool == kPool);
  REQUIRE(sim.segment_of(in_default).pool.is_default());
  sim.alloc.end_allocate_to_pool(kPool);
}

TEST_CASE("after the pool target ends, requests go to the default pool again", "[pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  sim.malloc(4096, kStream1);
  sim.alloc.end_allocate_to_pool(kPool);
  Block* b = sim.malloc(4096, kStream1);
  REQUIRE(sim.segment_of(b).pool.is_default());
  REQUIRE(sim.ledger().reserves == 2);  // the pool's segment has room, but it is not the default pool's
}

TEST_CASE("a pool request does not reuse the default pool's cached blocks", "[pools]") {
  Sim sim;
  Block* a = sim.malloc(4096, kStream1);
  sim.free(a);
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* b = sim.malloc(4096, kStream1);
  REQUIRE(sim.segment_of(b).pool == kPool);
  REQUIRE(sim.ledger().reserves == 2);
  sim.alloc.end_allocate_to_pool(kPool);
}

TEST_CASE("a block freed into a pool stays cached for that pool", "[pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* a = sim.malloc(12 * MiB, kStream1);
  const std::uintptr_t a_addr = a->addr;
  sim.alloc.end_allocate_to_pool(kPool);
  sim.free(a);

  Block* outside = sim.malloc(12 * MiB, kStream1);
  REQUIRE(outside->addr != a_addr);
  REQUIRE(sim.segment_of(outside).pool.is_default());

  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* inside = sim.malloc(12 * MiB, kStream1);
  REQUIRE(inside->addr == a_addr);
  REQUIRE(sim.ledger().reserves == 2);
  sim.alloc.end_allocate_to_pool(kPool);
}

TEST_CASE("the most recently begun pool takes a stream both accept", "[pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.create_pool(kOtherPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  sim.alloc.begin_allocate_to_pool(kOtherPool, [](StreamId) { return true; });
  REQUIRE(sim.segment_of(sim.malloc(4096, kStream1)).pool == kOtherPool);
  REQUIRE(sim.segment_of(sim.malloc(4096, kStream2)).pool == kOtherPool);
  sim.alloc.end_allocate_to_pool(kOtherPool);
  REQUIRE(sim.segment_of(sim.malloc(4096, kStream1)).pool == kPool);
  REQUIRE(sim.segment_of(sim.malloc(4096, kStream2)).pool.is_default());
  sim.alloc.end_allocate_to_pool(kPool);
}

TEST_CASE("empty_cache keeps a held pool's unused segments", "[pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* pooled = sim.malloc(12 * MiB, kStream1);
  sim.alloc.end_allocate_to_pool(kPool);
  Block* plain = sim.malloc(12 * MiB, kStream2);
  sim.free(pooled);
  sim.free(plain);

  sim.alloc.empty_cache();
  const auto snapshot = sim.snapshot();
  REQUIRE(snapshot.size() == 1);
  REQUIRE(snapshot[0].pool == kPool);
  REQUIRE(sim.ledger().in_use == 12 * MiB);
}

TEST_CASE("releasing a pool's last holder leaves its cache until empty_cache", "[pools][empty_cache]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* a = sim.malloc(12 * MiB, kStream1);
  Block* b = sim.malloc(4096, kStream1);
  sim.alloc.end_allocate_to_pool(kPool);
  sim.free(a);
  sim.free(b);

  sim.alloc.release_pool(kPool);  // native makes the pool freeable here, and frees nothing yet
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.pool_use_count(kPool) == 0);
  REQUIRE(sim.ledger().in_use == 14 * MiB);
  sim.alloc.empty_cache();
  REQUIRE(sim.ledger().in_use == 0);
  REQUIRE(sim.ledger().releases == 2);
  REQUIRE(sim.snapshot().empty());
}

TEST_CASE("a pool held twice keeps its cache until the last holder releases it", "[pools][empty_cache]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.create_pool(kPool);
  REQUIRE(sim.alloc.pool_use_count(kPool) == 2);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  sim.free(sim.malloc(12 * MiB, kStream1));
  sim.alloc.end_allocate_to_pool(kPool);

  sim.alloc.release_pool(kPool);
  sim.alloc.empty_cache(kPool);
  REQUIRE(sim.alloc.pool_use_count(kPool) == 1);
  REQUIRE(sim.ledger().in_use == 12 * MiB);
  sim.alloc.release_pool(kPool);
  sim.alloc.empty_cache(kPool);
  REQUIRE(sim.alloc.pool_use_count(kPool) == 0);
  REQUIRE(sim.ledger().in_use == 0);
}

TEST_CASE("a live block of a released pool keeps its segment until freed", "[pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* live = sim.malloc(12 * MiB, kStream1);
  sim.alloc.end_allocate_to_pool(kPool);

  sim.alloc.release_pool(kPool);
  sim.alloc.check_invariants();
  REQUIRE(sim.ledger().in_use == 12 * MiB);
  REQUIRE(sim.segment_of(live).pool == kPool);

  sim.free(live);
  sim.alloc.empty_cache();  // nothing holds the pool now: its cache may go
  REQUIRE(sim.ledger().in_use == 0);
  REQUIRE(sim.snapshot().empty());
}

TEST_CASE("an unheld pool's cached segment makes way at the cap", "[pools][cap]") {
  Sim sim(20 * MiB);
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* pooled = sim.malloc(12 * MiB, kStream1);
  sim.alloc.end_allocate_to_pool(kPool);
  sim.alloc.release_pool(kPool);
  sim.free(pooled);

  Block* b = sim.malloc(20 * MiB, kStream2);
  REQUIRE(b->size == 20 * MiB);
  REQUIRE(sim.ledger().releases == 1);
  REQUIRE(sim.ledger().peak <= 20 * MiB);
}

TEST_CASE("a held pool's cached segment does not make way at the cap", "[pools][cap][oom]") {
  Sim sim(20 * MiB);
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* pooled = sim.malloc(12 * MiB, kStream1);
  sim.alloc.end_allocate_to_pool(kPool);
  sim.free(pooled);

  const Oom oom = oom_from([&] { sim.malloc(20 * MiB, kStream2); });
  REQUIRE(oom.info.kind == OomKind::kFragmentation);
  REQUIRE(oom.info.largest_free_block == 12 * MiB);
  REQUIRE(sim.ledger().releases == 0);
}

TEST_CASE("allocating to a pool before it is created throws", "[pools]") {
  Sim sim;
  REQUIRE_THROWS_AS(sim.alloc.begin_allocate_to_pool(kPool, only(kStream1)), std::logic_error);
  REQUIRE_THROWS_WITH(sim.alloc.begin_allocate_to_pool(kPool, only(kStream1)), Catch::Contains("(1, 1)"));
  Block* b = sim.malloc(4096, kStream1);  // no target was left behind
  REQUIRE(sim.segment_of(b).pool.is_default());
}

TEST_CASE("a pool's use count starts at zero and counts holders", "[pools]") {
  Sim sim;
  REQUIRE(sim.alloc.pool_use_count(kPool) == 0);
  sim.alloc.create_pool(kPool);
  REQUIRE(sim.alloc.pool_use_count(kPool) == 1);
  sim.alloc.release_pool(kPool);
  REQUIRE(sim.alloc.pool_use_count(kPool) == 0);
  sim.alloc.release_pool(kPool);  // releasing an unheld pool is harmless
  REQUIRE(sim.alloc.pool_use_count(kPool) == 0);
}

TEST_CASE("a block freed with a stream use during pool allocation waits for the target to end", "[pools][streams]") {
  Sim sim;
  sim.backend.auto_complete_after(1);  // any event queried is done
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* a = sim.malloc(4096, kStream1);
  Block* keep = sim.malloc(512, kStream1);
  const std::uintptr_t a_addr = a->addr;
  sim.alloc.record_stream(a, kStream2);
  sim.free(a);
  REQUIRE(sim.ledger().live_events == 0);  // no event is recorded while a graph may be capturing
  REQUIRE(sim.segment_of(a).blocks[0].state == BlockInfo::kPendingFree);
  REQUIRE(sim.malloc(4096, kStream1)->addr != a_addr);

  sim.alloc.end_allocate_to_pool(kPool);
  sim.alloc.check_invariants();
  REQUIRE(sim.ledger().live_events == 1);  // recorded once the target ended
  sim.malloc(512, kStream3);  // outside the pool target the event is queried, and done
  REQUIRE(sim.ledger().live_events == 0);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  REQUIRE(sim.malloc(4096, kStream1)->addr == a_addr);
  sim.alloc.end_allocate_to_pool(kPool);
  (void)keep;
}

TEST_CASE("the device is not synchronized while a pool is the allocation target", "[pools][fallback][oom]") {
  Sim sim(20 * MiB);
  Block* a = sim.malloc(20 * MiB, kStream2);
  sim.alloc.record_stream(a, kStream3);
  sim.free(a);
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));

  REQUIRE_THROWS_AS(sim.malloc(20 * MiB, kStream2), OutOfMemoryError);
  REQUIRE(sim.ledger().syncs == 0);

  sim.alloc.end_allocate_to_pool(kPool);
  REQUIRE(sim.malloc(20 * MiB, kStream2)->size == 20 * MiB);
  REQUIRE(sim.ledger().syncs == 1);
}

// Under AddressSanitizer this catches a pool freed while pool_targets_ still points to it.
TEST_CASE("releasing a pool's last holder while it is the target keeps it until the target ends",
          "[pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  sim.alloc.release_pool(kPool);
  REQUIRE(sim.alloc.pool_use_count(kPool) == 0);

  Block* b = sim.malloc(4096, kStream1);  // the pool is still the target
  REQUIRE(sim.segment_of(b).pool == kPool);
  sim.alloc.end_allocate_to_pool(kPool);
  sim.free(b);
  sim.alloc.empty_cache();  // unheld and no longer the target: its cache goes
  REQUIRE(sim.ledger().in_use == 0);
}

// ---- empty_cache and pools, as native's emptyCache(pool) ----

namespace {

// A 12 MiB cached segment in the default pool, in kPool (held or not) and in kOtherPool (unheld).
struct ThreeCaches {
  Sim sim;
  explicit ThreeCaches(bool hold_pool) {
    sim.free(sim.malloc(12 * MiB, kStream2));
    for (PoolId id : {kPool, kOtherPool}) {
      sim.alloc.create_pool(id);
      sim.alloc.begin_allocate_to_pool(id, only(kStream1));
      sim.free(sim.malloc(12 * MiB, kStream1));
      sim.alloc.end_allocate_to_pool(id);
    }
    if (!hold_pool) sim.alloc.release_pool(kPool);
    sim.alloc.release_pool(kOtherPool);
  }
  bool cached(PoolId id) const {
    for (const SegmentInfo& s : sim.snapshot()) {
      if (s.pool == id) return true;
    }
    return false;
  }
};

}  // namespace

TEST_CASE("empty_cache of a pool id releases that pool's cache only", "[pools][empty_cache]") {
  ThreeCaches caches(false);
  caches.sim.alloc.empty_cache(kPool);
  REQUIRE_FALSE(caches.cached(kPool));
  REQUIRE(caches.cached(kOtherPool));
  REQUIRE(caches.cached(PoolId{}));
  REQUIRE(caches.sim.ledger().releases == 1);
}

TEST_CASE("empty_cache of a held pool's id releases nothing", "[pools][empty_cache]") {
  ThreeCaches caches(true);
  caches.sim.alloc.empty_cache(kPool);
  REQUIRE(caches.sim.ledger().releases == 0);
  REQUIRE(caches.sim.ledger().in_use == 36 * MiB);
}

TEST_CASE("empty_cache of an unknown pool id releases nothing", "[pools][empty_cache]") {
  ThreeCaches caches(false);
  caches.sim.alloc.empty_cache(PoolId{9, 9});
  REQUIRE(caches.sim.ledger().releases == 0);
}

TEST_CASE("empty_cache releases the default pool's and every unheld pool's cache, never a held pool's",
          "[pools][empty_cache]") {
  ThreeCaches caches(true);
  caches.sim.alloc.empty_cache();
  REQUIRE(caches.cached(kPool));
  REQUIRE_FALSE(caches.cached(kOtherPool));
  REQUIRE_FALSE(caches.cached(PoolId{}));
  REQUIRE(caches.sim.ledger().in_use == 12 * MiB);
}

TEST_CASE("empty_cache while a pool is the allocation target keeps the default pool's cache", "[pools][empty_cache]") {
  ThreeCaches caches(true);
  caches.sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  caches.sim.alloc.empty_cache();  // a graph may be capturing: freeing the default pool's memory would break it
  REQUIRE(caches.cached(PoolId{}));
  REQUIRE(caches.cached(kPool));
  REQUIRE_FALSE(caches.cached(kOtherPool));  // nobody holds it, nobody captures into it
  caches.sim.alloc.end_allocate_to_pool(kPool);
}

TEST_CASE("a pool emptied by its id is dropped once nothing is left in it", "[pools][empty_cache]") {
  ThreeCaches caches(false);
  caches.sim.alloc.empty_cache(kPool);
  REQUIRE(caches.sim.alloc.pool_use_count(kPool) == 0);
  REQUIRE_THROWS_AS(caches.sim.alloc.begin_allocate_to_pool(kPool, only(kStream1)), std::logic_error);
}

// ---- no_split ----

namespace {

// kPool with no_split, the allocation target for kStream1.
struct NoSplitSim : Sim {
  NoSplitSim() {
    alloc.create_pool(kPool);
    alloc.set_pool_option(kPool, PoolOption::kNoSplit, true);
    alloc.begin_allocate_to_pool(kPool, only(kStream1));
  }
};

}  // namespace

TEST_CASE("a no_split pool hands out a new small segment whole", "[pools][no_split]") {
  NoSplitSim sim;
  Block* b = sim.malloc(4096, kStream1);
  REQUIRE(b->size == kSmallSegment);
  REQUIRE(sim.segment_of(b).blocks.size() == 1);
  REQUIRE(sim.stats().allocated_bytes[kAll].current == static_cast<std::int64_t>(kSmallSegment));
  REQUIRE(sim.stats().requested_bytes[kAll].current == 4096);
}

TEST_CASE("a no_split pool takes a new segment rather than split one", "[pools][no_split]") {
  NoSplitSim sim;
  Block* a = sim.malloc(4096, kStream1);
  Block* b = sim.malloc(4096, kStream1);
  REQUIRE(a->segment != b->segment);
  REQUIRE(sim.ledger().reserves == 2);
  for (const SegmentInfo& s : sim.snapshot()) REQUIRE(s.blocks.size() == 1);
}

TEST_CASE("a no_split pool hands out a cached block whole", "[pools][no_split]") {
  NoSplitSim sim;
  Block* a = sim.malloc(3 * MiB, kStream1);  // a 20 MiB segment, whole
  REQUIRE(a->size == kMidSegment);
  const std::uintptr_t addr = a->addr;
  sim.free(a);
  Block* b = sim.malloc(2 * MiB, kStream1);
  REQUIRE(b->addr == addr);
  REQUIRE(b->size == kMidSegment);
  REQUIRE(sim.stats().inactive_split[kAll].current == 0);
}

TEST_CASE("other pools still split blocks", "[pools][no_split]") {
  NoSplitSim sim;
  REQUIRE(sim.malloc(4096, kStream2)->size == 4096);
  REQUIRE(sim.malloc(4096, kStream2)->segment->head->next != nullptr);
}

TEST_CASE("pool options on a pool that does not exist are refused", "[pools]") {
  Sim sim;
  REQUIRE_THROWS_AS(sim.alloc.set_pool_option(kPool, PoolOption::kNoSplit, true), std::invalid_argument);
  REQUIRE_THROWS_WITH(sim.alloc.set_pool_option(kPool, PoolOption::kUseOnOom, true), Catch::Contains("(1, 1)"));
}

TEST_CASE("a pool's no_split cannot be turned off, and refusing it changes nothing", "[pools][no_split]") {
  NoSplitSim sim;
  REQUIRE_THROWS_WITH(sim.alloc.set_pool_option(kPool, PoolOption::kNoSplit, false), Catch::Contains("only be turned on"));
  REQUIRE(sim.malloc(4096, kStream1)->segment->head->next == nullptr);  // still one block a segment
}

// ---- use_on_oom ----

namespace {

// Under a 20 MiB cap: kPool with use_on_oom (if asked), held, holding one cached 12 MiB block on
// kStream2, the stream the default-pool requests use.
struct OnOomSim : Sim {
  std::uintptr_t cached_addr = 0;
  explicit OnOomSim(bool use_on_oom = true) : Sim(20 * MiB) {
    alloc.create_pool(kPool);
    if (use_on_oom) alloc.set_pool_option(kPool, PoolOption::kUseOnOom, true);
    alloc.begin_allocate_to_pool(kPool, only(kStream2));
    Block* b = malloc(12 * MiB, kStream2);
    cached_addr = b->addr;
    alloc.end_allocate_to_pool(kPool);
    free(b);
  }
};

}  // namespace

TEST_CASE("a default-pool request that gets no new memory is served by a use_on_oom pool's cached block",
          "[pools][use_on_oom]") {
  OnOomSim sim;
  Block* b = sim.malloc(12 * MiB, kStream2);
  REQUIRE(b->addr == sim.cached_addr);
  REQUIRE(sim.segment_of(b).pool == kPool);
  REQUIRE(sim.ledger().reserves == 1);
  REQUIRE(sim.ledger().releases == 0);
  REQUIRE(sim.stats().allocated_bytes[kAll].current == static_cast<std::int64_t>(12 * MiB));
}

TEST_CASE("a block a use_on_oom pool lent goes back to that pool when freed", "[pools][use_on_oom]") {
  OnOomSim sim;
  sim.free(sim.malloc(12 * MiB, kStream2));
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream2));
  REQUIRE(sim.malloc(12 * MiB, kStream2)->addr == sim.cached_addr);
  REQUIRE(sim.ledger().reserves == 1);
  sim.alloc.end_allocate_to_pool(kPool);
}

TEST_CASE("without use_on_oom a held pool's cached block does not serve the default pool", "[pools][use_on_oom][oom]") {
  OnOomSim sim(false);
  REQUIRE(oom_from([&] { sim.malloc(12 * MiB, kStream2); }).info.kind == OomKind::kFragmentation);
}

TEST_CASE("a use_on_oom pool turned off no longer serves", "[pools][use_on_oom][oom]") {
  OnOomSim sim;
  sim.alloc.set_pool_option(kPool, PoolOption::kUseOnOom, false);
  REQUIRE_THROWS_AS(sim.malloc(12 * MiB, kStream2), OutOfMemoryError);
}

TEST_CASE("a use_on_oom pool is tried only once new memory failed", "[pools][use_on_oom]") {
  OnOomSim sim;
  Block* b = sim.malloc(4 * MiB, kStream2);  // a 20 MiB segment does not fit, a tight 4 MiB one does
  REQUIRE(sim.segment_of(b).pool.is_default());
  REQUIRE(sim.ledger().reserves == 2);
}

TEST_CASE("a released use_on_oom pool no longer serves: its cache makes way instead", "[pools][use_on_oom]") {
  OnOomSim sim;
  sim.alloc.release_pool(kPool);
  Block* b = sim.malloc(12 * MiB, kStream2);
  REQUIRE(sim.segment_of(b).pool.is_default());
  REQUIRE(sim.ledger().releases == 1);
}

TEST_CASE("a use_on_oom pool serves only requests on the stream of its block", "[pools][use_on_oom][oom]") {
  OnOomSim sim;
  REQUIRE_THROWS_AS(sim.malloc(12 * MiB, kStream3), OutOfMemoryError);
}

TEST_CASE("a request routed to a private pool does not borrow from a use_on_oom pool", "[pools][use_on_oom][oom]") {
  OnOomSim sim;
  sim.alloc.create_pool(kOtherPool);
  sim.alloc.begin_allocate_to_pool(kOtherPool, only(kStream2));
  REQUIRE_THROWS_AS(sim.malloc(12 * MiB, kStream2), OutOfMemoryError);
  sim.alloc.end_allocate_to_pool(kOtherPool);
}
