// num_sync_all_streams counts what native's counts: the passes that wait for every stream's pending
// frees before everything cached is released. One per empty_cache of the default pool (outside a
// capture), one per empty_cache of an unheld pool's id, one per release of everything before an
// OOM, whether or not anything was pending and whatever kind of segment holds the memory. The
// device synchronizations that releasing growable pages needs (sim.ledger().syncs) are not counted,
// as native does not count those of its expandable segments; nor does lowering the limit count.
#include "helpers.h"

using namespace gpumem_test;

namespace {

const PoolId kPool{1, 1};

// A block freed on kStream0 after a use on kStream1: its event stays pending until a sync.
void free_pending(Sim& sim, std::size_t size) {
  Block* b = sim.malloc(size);
  sim.alloc.record_stream(b, kStream1);
  sim.free(b);
}

std::int64_t syncs_counted(const Sim& sim) { return sim.stats().num_sync_all_streams; }

}  // namespace

TEST_CASE("empty_cache counts one sync with nothing pending", "[stats][sync]") {
  Sim sim;
  sim.free(sim.malloc(5 * MiB));
  sim.alloc.empty_cache();
  REQUIRE(syncs_counted(sim) == 1);
  REQUIRE(sim.ledger().syncs == 0);  // nothing to wait for: the device itself was not synchronized
}

TEST_CASE("empty_cache counts one sync with a free pending on another stream", "[stats][sync]") {
  Sim sim;
  free_pending(sim, 5 * MiB);
  sim.alloc.empty_cache();
  REQUIRE(syncs_counted(sim) == 1);
  REQUIRE(sim.ledger().syncs == 1);
  REQUIRE(sim.alloc.reserved() == 0);
}

TEST_CASE("empty_cache with growable segments counts one sync with nothing pending", "[stats][sync][growable]") {
  VmSim sim;
  sim.free(sim.malloc(5 * MiB));
  sim.alloc.empty_cache();
  REQUIRE(sim.ledger().unmaps == 1);
  REQUIRE(syncs_counted(sim) == 1);
}

TEST_CASE("empty_cache with growable segments counts one sync with a free pending", "[stats][sync][growable]") {
  VmSim sim;
  free_pending(sim, 5 * MiB);
  sim.alloc.empty_cache();
  REQUIRE(sim.alloc.reserved() == 0);
  REQUIRE(syncs_counted(sim) == 1);
}

TEST_CASE("each empty_cache counts one sync, also with nothing cached", "[stats][sync]") {
  VmSim sim;
  for (int i = 0; i < 3; ++i) sim.alloc.empty_cache();
  REQUIRE(syncs_counted(sim) == 3);
}

TEST_CASE("the release of everything before an OOM counts one sync with nothing pending", "[stats][sync][oom]") {
  Sim sim(40 * MiB);
  Block* pins[2] = {sim.malloc(2 * MiB), nullptr};
  Block* fill = sim.malloc(18 * MiB);
  pins[1] = sim.malloc(2 * MiB);
  sim.free(sim.malloc(18 * MiB));
  sim.free(fill);  // 36 MiB free under the limit, in two pinned segments: no 20 MiB block fits
  REQUIRE_THROWS_AS(sim.malloc(20 * MiB), OutOfMemoryError);
  REQUIRE(syncs_counted(sim) == 1);
  REQUIRE(sim.ledger().syncs == 0);
  for (Block* b : pins) sim.free(b);
}

TEST_CASE("an OOM the limit refuses outright counts no sync: no release could serve it", "[stats][sync][oom]") {
  Sim sim(20 * MiB);
  Block* held = sim.malloc(10 * MiB);
  REQUIRE_THROWS_AS(sim.malloc(20 * MiB), OutOfMemoryError);  // live blocks and request exceed the limit
  REQUIRE(syncs_counted(sim) == 0);  // native would count its release of everything here
  sim.free(held);
}

TEST_CASE("a request served by the release of everything counts one sync with growable segments",
          "[stats][sync][growable]") {
  VmSim sim(20 * MiB);
  Block* held = sim.malloc(10 * MiB);
  free_pending(sim, 6 * MiB);  // its pages come back only once the device is synchronized
  Block* b = sim.malloc(8 * MiB);
  REQUIRE(b->size >= 8 * MiB);
  REQUIRE(syncs_counted(sim) == 1);
  sim.free(b);
  sim.free(held);
}

TEST_CASE("a request the release of free pages serves counts no sync", "[stats][sync][growable]") {
  VmSim sim(20 * MiB);
  sim.free(sim.malloc(16 * MiB));
  sim.malloc(18 * MiB, kStream1);  // another stream: the free pages are unmapped, nothing is pending
  REQUIRE(syncs_counted(sim) == 0);
}

TEST_CASE("lowering the limit counts no sync, though unmapping synchronizes the device", "[stats][sync][growable][cap]") {
  VmSim sim;
  sim.free(sim.malloc(10 * MiB));
  const std::uint64_t device_syncs = sim.ledger().syncs;
  sim.alloc.set_limit(std::optional<std::size_t>(2 * MiB));
  REQUIRE(sim.ledger().unmaps >= 1);
  REQUIRE(sim.ledger().syncs == device_syncs + 1);
  REQUIRE(syncs_counted(sim) == 0);
}

TEST_CASE("empty_cache of an unheld pool's id counts one sync with nothing pending", "[stats][sync][pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, [](StreamId s) { return s == kStream1; });
  sim.free(sim.malloc(4 * MiB, kStream1));
  sim.alloc.end_allocate_to_pool(kPool);
  sim.alloc.release_pool(kPool);
  sim.alloc.empty_cache(kPool);
  REQUIRE(sim.ledger().releases == 1);
  REQUIRE(syncs_counted(sim) == 1);
}

TEST_CASE("empty_cache of a held pool's id counts no sync", "[stats][sync][pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.empty_cache(kPool);
  REQUIRE(syncs_counted(sim) == 0);
  sim.alloc.release_pool(kPool);
}

TEST_CASE("empty_cache while a pool is the allocation target counts no sync", "[stats][sync][pools]") {
  Sim sim;
  sim.alloc.create_pool(kPool);
  sim.alloc.begin_allocate_to_pool(kPool, [](StreamId s) { return s == kStream1; });
  sim.alloc.empty_cache();  // a graph may be capturing: native neither synchronizes nor counts
  REQUIRE(syncs_counted(sim) == 0);
  sim.alloc.end_allocate_to_pool(kPool);
  sim.alloc.release_pool(kPool);
}
