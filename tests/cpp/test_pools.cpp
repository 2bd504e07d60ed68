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

TEST_CASE("releasing a pool's last holder releases its cache", "[pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  Block* a = sim.malloc(12 * MiB, kStream1);
  Block* b = sim.malloc(4096, kStream1);
  sim.alloc.end_allocate_to_pool(kPool);
  sim.free(a);
  sim.free(b);
  REQUIRE(sim.ledger().in_use == 14 * MiB);

  sim.alloc.release_pool(kPool);
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.pool_use_count(kPool) == 0);
  REQUIRE(sim.ledger().in_use == 0);
  REQUIRE(sim.ledger().releases == 2);
  REQUIRE(sim.snapshot().empty());
}

TEST_CASE("a pool held twice keeps its cache until the last holder releases it", "[pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.create_pool(kPool);
  REQUIRE(sim.alloc.pool_use_count(kPool) == 2);
  sim.alloc.begin_allocate_to_pool(kPool, only(kStream1));
  sim.free(sim.malloc(12 * MiB, kStream1));
  sim.alloc.end_allocate_to_pool(kPool);

  sim.alloc.release_pool(kPool);
  REQUIRE(sim.alloc.pool_use_count(kPool) == 1);
  REQUIRE(sim.ledger().in_use == 12 * MiB);
  sim.alloc.release_pool(kPool);
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
