// Statistics (stats.h) after a known sequence, figure by figure, worked out by hand:
//
//   s1 = malloc(1000)    small: a 2 MiB segment, split into 1024 | 2 MiB - 1024 (free)
//   s2 = malloc(3000)    small: the free rest is cut into 3072 | 2 MiB - 4096 (free)
//   l1 = malloc(5 MiB)   large: a 20 MiB segment, split into 5 MiB | 15 MiB (free)
//   free(s1)             s1 cannot merge (s2 is live): a 1024-byte inactive split block
//
// Inactive split blocks move by each operation's net change, as native counts them: cutting a
// block that is already split only takes bytes from it.
#include <algorithm>
#include <random>
#include <set>

#include "helpers.h"

using namespace gpumem_test;

namespace {

using I = std::int64_t;
constexpr I kMiB = static_cast<I>(MiB);

DeviceStats known_sequence(Sim& sim) {
  Block* s1 = sim.malloc(1000);
  sim.malloc(3000);
  sim.malloc(5 * MiB);
  sim.free(s1);
  return sim.stats();
}

DeviceStats known_sequence() {
  Sim sim;
  return known_sequence(sim);
}

void require_stat(const Stat& s, I current, I peak, I allocated, I freed) {
  CHECK(s.current == current);
  CHECK(s.peak == peak);
  CHECK(s.allocated == allocated);
  CHECK(s.freed == freed);
}

std::int64_t lookup(const std::vector<StatEntry>& flat, const std::string& key) {
  for (const StatEntry& e : flat) {
    if (e.first == key) return e.second;
  }
  FAIL("no statistic named " << key);
  return 0;
}

// Allocates `size` bytes on stream 0 and frees them while stream 1 still uses them: a pending block.
void free_while_in_use(Sim& sim, std::size_t size) {
  Block* block = sim.malloc(size);
  sim.alloc.record_stream(block, kStream1);
  sim.free(block);
}

}  // namespace

// ---- the arrays after the known sequence ------------------------------------------------------

TEST_CASE("allocation counts blocks handed out and not yet freed", "[stats]") {
  const DeviceStats s = known_sequence();
  require_stat(s.allocation[kAll], 2, 3, 3, 1);
  require_stat(s.allocation[kSmallPool], 1, 2, 2, 1);
  require_stat(s.allocation[kLargePool], 1, 1, 1, 0);
}

TEST_CASE("segment counts segments reserved from the device", "[stats]") {
  const DeviceStats s = known_sequence();
  require_stat(s.segment[kAll], 2, 2, 2, 0);
  require_stat(s.segment[kSmallPool], 1, 1, 1, 0);
  require_stat(s.segment[kLargePool], 1, 1, 1, 0);
}

TEST_CASE("active counts allocated blocks and blocks pending on a stream", "[stats]") {
  const DeviceStats s = known_sequence();
  require_stat(s.active[kAll], 2, 3, 3, 1);
  require_stat(s.active[kSmallPool], 1, 2, 2, 1);
  require_stat(s.active[kLargePool], 1, 1, 1, 0);
}

TEST_CASE("inactive_split counts free blocks that share a segment", "[stats]") {
  const DeviceStats s = known_sequence();
  // small: +1 (s1's rest), 0 (s2 cuts the rest, which stays split), +1 (s1 freed)
  require_stat(s.inactive_split[kAll], 3, 3, 3, 0);
  require_stat(s.inactive_split[kSmallPool], 2, 2, 2, 0);
  require_stat(s.inactive_split[kLargePool], 1, 1, 1, 0);
}

TEST_CASE("allocated_bytes counts the rounded sizes of allocated blocks", "[stats]") {
  const DeviceStats s = known_sequence();
  require_stat(s.allocated_bytes[kAll], 5 * kMiB + 3072, 5 * kMiB + 4096, 5 * kMiB + 4096, 1024);
  require_stat(s.allocated_bytes[kSmallPool], 3072, 4096, 4096, 1024);
  require_stat(s.allocated_bytes[kLargePool], 5 * kMiB, 5 * kMiB, 5 * kMiB, 0);
}

TEST_CASE("reserved_bytes counts the bytes of segments", "[stats]") {
  const DeviceStats s = known_sequence();
  require_stat(s.reserved_bytes[kAll], 22 * kMiB, 22 * kMiB, 22 * kMiB, 0);
  require_stat(s.reserved_bytes[kSmallPool], 2 * kMiB, 2 * kMiB, 2 * kMiB, 0);
  require_stat(s.reserved_bytes[kLargePool], 20 * kMiB, 20 * kMiB, 20 * kMiB, 0);
}

TEST_CASE("active_bytes counts the bytes of active blocks", "[stats]") {
  const DeviceStats s = known_sequence();
  require_stat(s.active_bytes[kAll], 5 * kMiB + 3072, 5 * kMiB + 4096, 5 * kMiB + 4096, 1024);
  require_stat(s.active_bytes[kSmallPool], 3072, 4096, 4096, 1024);
  require_stat(s.active_bytes[kLargePool], 5 * kMiB, 5 * kMiB, 5 * kMiB, 0);
}

TEST_CASE("inactive_split_bytes counts the bytes of free blocks that share a segment", "[stats]") {
  const DeviceStats s = known_sequence();
  // small: +(2M-1024), then -3072 (s2's bytes), then +1024 (s1 freed)
  require_stat(s.inactive_split_bytes[kSmallPool], 2 * kMiB - 3072, 2 * kMiB - 1024, 2 * kMiB, 3072);
  require_stat(s.inactive_split_bytes[kLargePool], 15 * kMiB, 15 * kMiB, 15 * kMiB, 0);
  require_stat(s.inactive_split_bytes[kAll], 17 * kMiB - 3072, 17 * kMiB - 3072, 17 * kMiB, 3072);
}

TEST_CASE("requested_bytes counts the bytes callers asked for before rounding", "[stats]") {
  const DeviceStats s = known_sequence();
  require_stat(s.requested_bytes[kAll], 5 * kMiB + 3000, 5 * kMiB + 4000, 5 * kMiB + 4000, 1000);
  require_stat(s.requested_bytes[kSmallPool], 3000, 4000, 4000, 1000);
  require_stat(s.requested_bytes[kLargePool], 5 * kMiB, 5 * kMiB, 5 * kMiB, 0);
}

TEST_CASE("the small and large entries add up to all", "[stats]") {
  Sim sim;
  const std::vector<StatEntry> flat = flatten(known_sequence(sim));
  for (const StatEntry& e : flat) {
    const std::string key = e.first;
    const auto dot = key.find(".all.");
    if (dot == std::string::npos) continue;
    const std::string name = key.substr(0, dot), field = key.substr(dot + 5);
    if (field == "peak") continue;  // the pools peak at different moments
    INFO(key);
    CHECK(e.second == lookup(flat, name + ".small_pool." + field) + lookup(flat, name + ".large_pool." + field));
  }
}

// ---- counters ---------------------------------------------------------------------------------

TEST_CASE("a fresh allocator has every statistic at zero", "[stats]") {
  Sim sim;
  for (const StatEntry& e : flatten(sim.stats())) {
    INFO(e.first);
    CHECK(e.second == 0);
  }
}

TEST_CASE("the counters count device calls, retries, syncs, releases and OOMs", "[stats]") {
  Sim sim(30 * MiB);
  Block* a = sim.malloc(20 * MiB);
  sim.free(a);
  Block* b = sim.malloc(20 * MiB, kStream1);  // releases a's segment to make room: a retry
  REQUIRE_THROWS_AS(sim.malloc(20 * MiB), OutOfMemoryError);
  sim.alloc.record_stream(b, kStream2);
  sim.free(b);
  sim.malloc(30 * MiB);  // only syncing frees b's segment: a second retry

  const DeviceStats s = sim.stats();
  CHECK(s.num_device_alloc == 3);
  CHECK(s.num_device_free == 2);
  CHECK(s.num_alloc_retries == 2);
  CHECK(s.num_cache_releases == 2);
  CHECK(s.num_sync_all_streams == 1);  // the last request's release of everything; the OOM is refused outright
  CHECK(s.num_ooms == 1);
  CHECK(static_cast<std::uint64_t>(s.num_device_alloc) == sim.ledger().reserves);
  CHECK(static_cast<std::uint64_t>(s.num_device_free) == sim.ledger().releases);
  CHECK(sim.ledger().syncs == 1);
}

TEST_CASE("empty_cache counts one cache release and one device free per segment", "[stats]") {
  Sim sim;
  Block* blocks[3] = {sim.malloc(4096), sim.malloc(12 * MiB), sim.malloc(5 * MiB)};
  for (Block* b : blocks) sim.free(b);
  sim.alloc.empty_cache();
  const DeviceStats s = sim.stats();
  CHECK(s.num_cache_releases == 1);
  CHECK(s.num_device_free == 3);
  require_stat(s.segment[kAll], 0, 3, 3, 3);
  require_stat(s.reserved_bytes[kAll], 0, 34 * kMiB, 34 * kMiB, 34 * kMiB);
}

TEST_CASE("reserved_bytes agrees with the device's ledger", "[stats]") {
  Sim sim;
  known_sequence(sim);
  REQUIRE(sim.stats().reserved_bytes[kAll].current == static_cast<I>(sim.ledger().in_use));
  REQUIRE(sim.stats().reserved_bytes[kAll].peak == static_cast<I>(sim.ledger().peak));
}

// ---- resets -----------------------------------------------------------------------------------

TEST_CASE("reset_peak_stats sets every peak to its current value", "[stats]") {
  Sim sim;
  const DeviceStats before = known_sequence(sim);
  sim.alloc.reset_peak_stats();
  const DeviceStats s = sim.stats();
  require_stat(s.allocated_bytes[kAll], 5 * kMiB + 3072, 5 * kMiB + 3072, 5 * kMiB + 4096, 1024);
  require_stat(s.inactive_split_bytes[kSmallPool], 2 * kMiB - 3072, 2 * kMiB - 3072, 2 * kMiB, 3072);
  const std::vector<StatEntry> flat = flatten(s), flat_before = flatten(before);
  for (const StatEntry& e : flat) {
    const auto dot = e.first.rfind('.');
    if (dot == std::string::npos) continue;
    const std::string base = e.first.substr(0, dot);
    if (e.first.substr(dot + 1) == "peak") {
      INFO(e.first);
      CHECK(e.second == lookup(flat, base + ".current"));
    }
  }
  CHECK(s.num_device_alloc == before.num_device_alloc);
}

TEST_CASE("peaks rise again after reset_peak_stats", "[stats]") {
  Sim sim;
  known_sequence(sim);
  sim.alloc.reset_peak_stats();
  Block* b = sim.malloc(100 * KiB);
  sim.free(b);
  const DeviceStats s = sim.stats();
  CHECK(s.allocated_bytes[kAll].peak == 5 * kMiB + 3072 + 100 * 1024);
  CHECK(s.allocated_bytes[kAll].current == 5 * kMiB + 3072);
}

TEST_CASE("reset_accumulated_stats zeroes allocated, freed and the counters only", "[stats]") {
  Sim sim(30 * MiB);
  known_sequence(sim);
  REQUIRE_THROWS_AS(sim.malloc(30 * MiB), OutOfMemoryError);
  sim.alloc.reset_accumulated_stats();
  const DeviceStats s = sim.stats();
  require_stat(s.allocation[kAll], 2, 3, 0, 0);
  require_stat(s.reserved_bytes[kLargePool], 20 * kMiB, 20 * kMiB, 0, 0);
  require_stat(s.requested_bytes[kSmallPool], 3000, 4000, 0, 0);
  for (const StatEntry& e : flatten(s)) {
    const bool accumulated = e.first.size() > 10 && (e.first.compare(e.first.size() - 10, 10, ".allocated") == 0);
    const bool freed = e.first.size() > 6 && e.first.compare(e.first.size() - 6, 6, ".freed") == 0;
    const bool counter = e.first.rfind("num_", 0) == 0;
    if (!accumulated && !freed && !counter) continue;
    INFO(e.first);
    CHECK(e.second == 0);
  }
}

TEST_CASE("statistics keep counting from zero after reset_accumulated_stats", "[stats]") {
  Sim sim;
  known_sequence(sim);
  sim.alloc.reset_accumulated_stats();
  Block* b = sim.malloc(16 * MiB);  // more than the 15 MiB free: a new segment
  sim.free(b);
  sim.alloc.check_invariants();
  const DeviceStats s = sim.stats();
  require_stat(s.allocated_bytes[kLargePool], 5 * kMiB, 21 * kMiB, 16 * kMiB, 16 * kMiB);
  require_stat(s.segment[kLargePool], 2, 2, 1, 0);
  CHECK(s.num_device_alloc == 1);
}

// ---- inactive split blocks: each operation's net change --------------------------------------

TEST_CASE("a free that merges a split neighbour moves inactive_split by the net change only", "[stats]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB);
  Block* b = sim.malloc(4 * KiB);
  sim.malloc(4 * KiB);  // keeps the segment's rest apart from b
  sim.free(a);          // a: a new inactive split block
  sim.alloc.reset_accumulated_stats();
  sim.free(b);          // b folds into a: one inactive split block, 4 KiB larger
  const DeviceStats s = sim.stats();
  require_stat(s.inactive_split[kSmallPool], 2, 2, 0, 0);
  CHECK(s.inactive_split_bytes[kSmallPool].allocated == 4 * static_cast<I>(KiB));
  CHECK(s.inactive_split_bytes[kSmallPool].freed == 0);
}

TEST_CASE("a split block handed out whole is one inactive split block fewer", "[stats]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB);
  sim.malloc(4 * KiB);
  sim.free(a);  // a 4 KiB inactive split block
  sim.alloc.reset_accumulated_stats();
  REQUIRE(sim.malloc(4 * KiB)->addr == a->addr);
  const DeviceStats s = sim.stats();
  CHECK(s.inactive_split[kSmallPool].current == 1);  // the segment's rest
  CHECK(s.inactive_split[kSmallPool].freed == 1);
  CHECK(s.inactive_split_bytes[kSmallPool].freed == 4 * static_cast<I>(KiB));
  CHECK(s.inactive_split_bytes[kSmallPool].allocated == 0);
}

TEST_CASE("growable segments hold no inactive split blocks, as native's expandable segments", "[stats][growable]") {
  VmSim sim;
  Block* a = sim.malloc(5 * MiB);
  Block* b = sim.malloc(3 * MiB);
  sim.malloc(1 * MiB);
  REQUIRE(a->segment->growable);
  sim.free(a);
  sim.free(b);
  const DeviceStats s = sim.stats();
  for (int t = 0; t < kNumStatTypes; ++t) {
    INFO(kStatTypeNames[t]);
    require_stat(s.inactive_split[t], 0, 0, 0, 0);
    require_stat(s.inactive_split_bytes[t], 0, 0, 0, 0);
  }
}

// ---- active while blocks are pending on a stream ----------------------------------------------

TEST_CASE("active's peak counts a block pending on a stream while allocation's does not", "[stats][streams]") {
  Sim sim;
  free_while_in_use(sim, 4 * KiB);     // pending: active 1, allocation 0
  Block* b = sim.malloc(8 * KiB);      // active 2, allocation 1
  DeviceStats s = sim.stats();
  require_stat(s.allocation[kSmallPool], 1, 1, 2, 1);
  require_stat(s.active[kSmallPool], 2, 2, 2, 0);
  require_stat(s.active[kAll], 2, 2, 2, 0);
  require_stat(s.active_bytes[kAll], 12 * static_cast<I>(KiB), 12 * static_cast<I>(KiB), 12 * static_cast<I>(KiB), 0);
  require_stat(s.active_bytes[kLargePool], 0, 0, 0, 0);

  sim.backend.complete_events();
  sim.free(b);
  sim.malloc(512);  // the request retires a first: active 1
  s = sim.stats();
  require_stat(s.active[kSmallPool], 1, 2, 3, 2);
  require_stat(s.active_bytes[kSmallPool], 512, 12 * static_cast<I>(KiB), 12 * static_cast<I>(KiB) + 512,
               12 * static_cast<I>(KiB));
}

TEST_CASE("active's peak in one pool rises with a block pending in the other", "[stats][streams]") {
  Sim sim;
  free_while_in_use(sim, 2 * MiB);  // pending in the large pool
  sim.malloc(4 * KiB);          // active: small 1, large 1, all 2
  const DeviceStats s = sim.stats();
  CHECK(s.active[kAll].peak == 2);
  CHECK(s.active[kSmallPool].peak == 1);
  CHECK(s.active[kLargePool].peak == 1);
  CHECK(s.active_bytes[kAll].peak == 2 * kMiB + 4 * static_cast<I>(KiB));
  CHECK(s.allocated_bytes[kAll].peak == 2 * kMiB);
}

TEST_CASE("reset_peak_stats counts pending blocks in active's peak", "[stats][streams]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB);
  Block* b = sim.malloc(4 * KiB);
  sim.alloc.record_stream(a, kStream1);
  sim.free(a);
  sim.free(b);
  sim.alloc.reset_peak_stats();  // active is a (pending) alone
  const DeviceStats s = sim.stats();
  require_stat(s.active[kAll], 1, 1, 2, 1);
  CHECK(s.active_bytes[kAll].peak == 4 * static_cast<I>(KiB));
  CHECK(s.allocation[kAll].peak == 0);
}

TEST_CASE("a block pending on a stream keeps its request in requested_bytes until it retires", "[stats][streams]") {
  Sim sim;
  free_while_in_use(sim, 4000);
  CHECK(sim.stats().requested_bytes[kAll].current == 4000);
  CHECK(sim.snapshot()[0].blocks[0].requested == 4000);
  sim.backend.complete_events();
  sim.malloc(512);  // retires a
  const DeviceStats s = sim.stats();
  require_stat(s.requested_bytes[kAll], 512, 4000, 4512, 4000);
}

TEST_CASE("a block freed on another stream while a graph captures stays active and requested until it retires", "[stats][streams][pools]") {
  Sim sim;
  const PoolId pool{1, 1};
  sim.alloc.create_pool(pool);
  sim.alloc.begin_allocate_to_pool(pool, [](StreamId s) { return s == kStream1; });
  Block* a = sim.malloc(4000, kStream1);
  sim.alloc.record_stream(a, kStream2);
  sim.free(a);                      // held while the capture lasts
  sim.malloc(8 * KiB, kStream1);    // active: a and this block
  DeviceStats s = sim.stats();
  require_stat(s.active[kAll], 2, 2, 2, 0);
  CHECK(s.allocation[kAll].peak == 1);
  CHECK(s.requested_bytes[kAll].current == 4000 + 8 * static_cast<I>(KiB));

  sim.alloc.end_allocate_to_pool(pool);  // the held block now waits on an event
  sim.backend.complete_events();
  sim.malloc(512);                       // retires a
  s = sim.stats();
  require_stat(s.active[kAll], 2, 2, 3, 1);
  require_stat(s.requested_bytes[kAll], 8 * static_cast<I>(KiB) + 512, 4000 + 8 * static_cast<I>(KiB),
               4000 + 8 * static_cast<I>(KiB) + 512, 4000);
}

TEST_CASE("a block pending across reset_accumulated_stats counts as freed once when it retires", "[stats][streams]") {
  Sim sim;
  free_while_in_use(sim, 4 * KiB);
  sim.alloc.reset_accumulated_stats();
  sim.backend.complete_events();
  sim.malloc(512);  // retires a, hands out 512 bytes
  const DeviceStats s = sim.stats();
  require_stat(s.active[kAll], 1, 1, 1, 1);
  require_stat(s.active_bytes[kAll], 512, 4 * static_cast<I>(KiB), 512, 4 * static_cast<I>(KiB));
  require_stat(s.allocation[kAll], 1, 1, 1, 0);
}

TEST_CASE("active's peak and accumulated figures follow every operation, with streams and resets", "[stats][streams]") {
  Sim sim;
  std::mt19937_64 rng(7);
  std::vector<Block*> live;
  I peak[kNumStatTypes] = {0, 0, 0};
  I peak_bytes[kNumStatTypes] = {0, 0, 0};
  I base[kNumStatTypes] = {0, 0, 0};  // active's current at the last reset_accumulated_stats
  // Counted here, not read from the ledger: blocks handed out, and blocks that stopped being
  // active (freed with no stream using them, or retired after pending), since the last reset.
  I handed_out = 0, left_active = 0;
  const auto pending_now = [&] {
    I n = 0;
    for (const SegmentInfo& seg : sim.snapshot()) {
      for (const BlockInfo& b : seg.blocks) n += b.state == BlockInfo::kPendingFree ? 1 : 0;
    }
    return n;
  };
  for (int op = 0; op < 4000; ++op) {
    const auto pick = rng() % 100;
    const I pending_before = pending_now();
    I pended = 0;
    if (pick < 45 || live.empty()) {
      const std::size_t size = std::size_t{512} << (rng() % 14);  // 512 B .. 4 MiB
      live.push_back(sim.malloc(size, static_cast<StreamId>(rng() % 2)));
      ++handed_out;
    } else if (pick < 85) {
      const std::size_t i = rng() % live.size();
      if (rng() % 3 == 0) {
        sim.alloc.record_stream(live[i], kStream2);  // another stream than the block's
        pended = 1;
      } else {
        ++left_active;
      }
      sim.free(live[i]);
      live[i] = live.back();
      live.pop_back();
    } else if (pick < 95) {
      sim.backend.complete_events();
    } else if (pick < 98) {
      sim.alloc.reset_peak_stats();
      const DeviceStats s = sim.stats();
      for (int t = 0; t < kNumStatTypes; ++t) {
        peak[t] = s.active[t].current;
        peak_bytes[t] = s.active_bytes[t].current;
      }
    } else {
      sim.alloc.reset_accumulated_stats();
      const DeviceStats s = sim.stats();
      for (int t = 0; t < kNumStatTypes; ++t) base[t] = s.active[t].current;
      handed_out = left_active = 0;
    }
    left_active += pending_before + pended - pending_now();  // the blocks retired by this operation
    const DeviceStats s = sim.stats();
    REQUIRE(s.active[kAll].allocated == handed_out);
    REQUIRE(s.active[kAll].freed == left_active);
    for (int t = 0; t < kNumStatTypes; ++t) {
      INFO("operation " << op << ", " << kStatTypeNames[t]);
      peak[t] = std::max(peak[t], s.active[t].current);
      peak_bytes[t] = std::max(peak_bytes[t], s.active_bytes[t].current);
      REQUIRE(s.active[t].peak == peak[t]);
      REQUIRE(s.active_bytes[t].peak == peak_bytes[t]);
      REQUIRE(s.active[t].allocated == s.allocation[t].allocated);
      REQUIRE(s.active[t].allocated - s.active[t].freed == s.active[t].current - base[t]);
    }
  }
  sim.alloc.check_invariants();
}

// ---- flatten ----------------------------------------------------------------------------------

TEST_CASE("flatten names every figure of every array and every counter", "[stats]") {
  const std::vector<StatEntry> flat = flatten(known_sequence());
  REQUIRE(flat.size() == 9 * 3 * 4 + 9);
  std::set<std::string> keys;
  for (const StatEntry& e : flat) keys.insert(e.first);
  REQUIRE(keys.size() == flat.size());
  for (const char* key : {"allocation.all.current", "segment.small_pool.peak", "active.large_pool.allocated",
                          "inactive_split.all.freed", "allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
                          "active_bytes.small_pool.freed", "inactive_split_bytes.all.allocated",
                          "requested_bytes.small_pool.current", "num_alloc_retries", "num_ooms", "num_ooms_over_limit",
                          "num_ooms_device_full", "num_ooms_fragmentation", "num_sync_all_streams",
                          "num_device_alloc", "num_device_free", "num_cache_releases"}) {
    INFO(key);
    CHECK(keys.count(key) == 1);
  }
}

TEST_CASE("flatten gives each key its figure", "[stats]") {
  const DeviceStats s = known_sequence();
  const std::vector<StatEntry> flat = flatten(s);
  CHECK(lookup(flat, "allocated_bytes.all.current") == 5 * kMiB + 3072);
  CHECK(lookup(flat, "allocated_bytes.small_pool.peak") == 4096);
  CHECK(lookup(flat, "requested_bytes.small_pool.freed") == 1000);
  CHECK(lookup(flat, "reserved_bytes.large_pool.allocated") == 20 * kMiB);
  CHECK(lookup(flat, "segment.all.current") == 2);
  CHECK(lookup(flat, "num_device_alloc") == 2);
  CHECK(lookup(flat, "num_ooms") == 0);
}

TEST_CASE("flatten lists the arrays before the counters", "[stats]") {
  const std::vector<StatEntry> flat = flatten(known_sequence());
  REQUIRE(flat.front().first == "allocation.all.current");
  REQUIRE(flat.back().first == "num_cache_releases");
  bool seen_counter = false;
  for (const StatEntry& e : flat) {
    const bool counter = e.first.find('.') == std::string::npos;
    CHECK_FALSE((seen_counter && !counter));
    seen_counter = seen_counter || counter;
  }
}

TEST_CASE("a request that releases cache twice counts as one retry", "[stats][fallback]") {
  // num_alloc_retries counts "requests that released cached memory and tried again" (stats.h).
  // Here one request goes through both the release policy and the synchronize step.
  Sim sim;
  Block* cached = sim.malloc(20 * MiB, kStream1);
  sim.free(cached);
  sim.backend.fail_when([](int, std::size_t) { return true; });
  REQUIRE_THROWS_AS(sim.malloc(20 * MiB, kStream2), OutOfMemoryError);
  REQUIRE(sim.stats().num_ooms == 1);
  REQUIRE(sim.stats().num_alloc_retries == 1);
}

// ---- caching off, and what the cap counts ----------------------------------------------------

TEST_CASE("memory handed out while caching is off counts as a reserved segment holding an allocated block",
          "[stats][uncached]") {
  Sim sim;
  void* ptr = sim.alloc.malloc_uncached(3 * MiB + 1);
  const I bytes = 3 * kMiB + 512;
  DeviceStats s = sim.stats();
  require_stat(s.reserved_bytes[kAll], bytes, bytes, bytes, 0);
  require_stat(s.allocated_bytes[kAll], bytes, bytes, bytes, 0);
  require_stat(s.segment[kLargePool], 1, 1, 1, 0);
  require_stat(s.allocation[kLargePool], 1, 1, 1, 0);
  CHECK(s.requested_bytes[kAll].current == 3 * kMiB + 1);
  CHECK(s.num_device_alloc == 1);
  CHECK(static_cast<I>(sim.alloc.reserved()) == s.reserved_bytes[kAll].current);
  REQUIRE(sim.alloc.free_uncached(ptr));
  s = sim.stats();
  require_stat(s.reserved_bytes[kAll], 0, bytes, bytes, bytes);
  require_stat(s.allocated_bytes[kAll], 0, bytes, bytes, bytes);
  CHECK(s.requested_bytes[kAll].current == 0);
  CHECK(s.num_device_free == 1);
  sim.alloc.check_invariants();
}

TEST_CASE("the cap keeps the peak of what it counts beside it, reset with the statistics' peaks", "[stats][cap]") {
  Sim sim;
  Block* big = sim.malloc(40 * MiB);
  sim.free(sim.malloc(100 * MiB));
  sim.alloc.empty_cache();
  CHECK(sim.alloc.cap().counted() == 40 * MiB);
  CHECK(sim.alloc.cap().counted_peak() == 140 * MiB);
  sim.alloc.reset_peak_stats();
  CHECK(sim.alloc.cap().counted_peak() == 40 * MiB);
  sim.free(big);
  CHECK(sim.alloc.cap().counted_peak() >= sim.alloc.cap().counted());
}
