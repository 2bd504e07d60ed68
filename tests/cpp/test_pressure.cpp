// Pressure watches (core/pressure.h): crossings of a share of the limit, counted where reserved
// grows, re-armed where it falls back, and the per-case out-of-memory counters beside them.
#include <cmath>
#include <limits>
#include <vector>

#include "core/caching_allocator.h"
#include "core/pressure.h"
#include "helpers.h"

using namespace gpumem_test;

namespace {

constexpr std::size_t kLimit = 1000;

std::vector<PressureCount> counts(const PressureWatches& watches) {
  std::vector<PressureCount> out;
  watches.for_each([&](const PressureCount& c) { out.push_back(c); });
  return out;
}

std::uint64_t crossings(const PressureWatches& watches) {
  const std::vector<PressureCount> c = counts(watches);
  REQUIRE(c.size() == 1);
  return c[0].crossings;
}

std::uint64_t crossings(const DeviceAllocator& device) { return crossings(device.cap().pressure()); }

// One watch at 0.85 of a 1000-byte limit: high mark 850, low mark 800.
void watch_at_85(PressureWatches& w) { w.watch(0, 0.85, kLimit, 0); }

}  // namespace

// ---- the watches alone ------------------------------------------------------------------------

TEST_CASE("reserved growing to the share of the limit counts one crossing", "[pressure]") {
  PressureWatches w;
  watch_at_85(w);
  w.grew(849);
  REQUIRE(crossings(w) == 0);
  w.grew(850);
  REQUIRE(crossings(w) == 1);
  REQUIRE(counts(w)[0].reserved_at_crossing == 850);
  REQUIRE(counts(w)[0].share == 0.85);
}

TEST_CASE("growth above the mark counts no more crossings until reserved falls to the low mark", "[pressure]") {
  PressureWatches w;
  watch_at_85(w);
  w.grew(900);
  w.shrank(801);  // under the high mark, above the low one: still disarmed
  w.grew(990);
  REQUIRE(crossings(w) == 1);
  w.shrank(800);
  w.grew(860);
  REQUIRE(crossings(w) == 2);
  REQUIRE(counts(w)[0].reserved_at_crossing == 860);
}

TEST_CASE("a share of 1 crosses when reserved reaches the limit", "[pressure]") {
  PressureWatches w;
  w.watch(0, 1.0, kLimit, 0);
  w.grew(999);
  REQUIRE(crossings(w) == 0);
  w.grew(1000);
  REQUIRE(crossings(w) == 1);
}

TEST_CASE("a share at or under the gap re-arms only when reserved is back at zero", "[pressure]") {
  PressureWatches w;
  w.watch(0, 0.05, kLimit, 0);
  w.grew(50);
  w.shrank(1);
  w.grew(50);
  REQUIRE(crossings(w) == 1);
  w.shrank(0);
  w.grew(50);
  REQUIRE(crossings(w) == 2);
}

TEST_CASE("a watch set while reserved is already past its mark counts a crossing at once", "[pressure]") {
  PressureWatches w;
  w.watch(0, 0.5, kLimit, 600);
  REQUIRE(crossings(w) == 1);
}

TEST_CASE("watching a slot again at the same share keeps its counts", "[pressure]") {
  PressureWatches w;
  watch_at_85(w);
  w.grew(900);
  w.watch(0, 0.85, kLimit, 900);
  REQUIRE(crossings(w) == 1);
}

TEST_CASE("lowering the limit under reserved's share counts a crossing; raising it re-arms", "[pressure]") {
  PressureWatches w;
  watch_at_85(w);
  w.grew(700);
  w.set_limit(800, 700);  // high 680
  REQUIRE(crossings(w) == 1);
  w.set_limit(2000, 700);  // low 1600: re-armed, high 1700 not reached
  REQUIRE(crossings(w) == 1);
  w.grew(1700);
  REQUIRE(crossings(w) == 2);
}

TEST_CASE("each share counts its own crossings", "[pressure]") {
  PressureWatches w;
  w.watch(0, 0.5, kLimit, 0);
  w.watch(1, 0.9, kLimit, 0);
  w.grew(600);
  w.grew(950);
  w.shrank(400);
  w.grew(600);
  const std::vector<PressureCount> c = counts(w);
  REQUIRE(c.size() == 2);
  REQUIRE(c[0].crossings == 2);
  REQUIRE(c[1].crossings == 1);
}

TEST_CASE("a share too small for a byte still needs memory reserved to cross", "[pressure]") {
  PressureWatches w;
  w.watch(0, 1e-9, kLimit, 0);
  REQUIRE(crossings(w) == 0);
  w.grew(1);
  REQUIRE(crossings(w) == 1);
}

TEST_CASE("the marks of the largest limit do not overflow", "[pressure]") {
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  PressureWatches w;
  w.watch(0, 1.0, kMax, 0);
  w.grew(kMax - 1);
  REQUIRE(crossings(w) == 0);
  w.grew(kMax);
  REQUIRE(crossings(w) == 1);
}

TEST_CASE("shares of 0 or less and above 1 are refused", "[pressure]") {
  PressureWatches w;
  for (double share : {0.0, -0.5, 1.0001, std::nan("")}) {
    INFO(share);
    REQUIRE_THROWS_AS(w.watch(0, share, kLimit, 0), LimitSpecError);
  }
  REQUIRE(counts(w).empty());
}

// ---- on a device ------------------------------------------------------------------------------

TEST_CASE("a new segment past the share counts a crossing; reusing cached memory counts none", "[pressure]") {
  Sim sim(100 * MiB);
  sim.alloc.watch_pressure(0, 0.5);
  Block* a = sim.malloc(60 * MiB);
  REQUIRE(crossings(sim.alloc) == 1);
  sim.free(a);
  Block* b = sim.malloc(60 * MiB);  // the cached segment: reserved did not grow
  REQUIRE(sim.ledger().reserves == 1);
  REQUIRE(crossings(sim.alloc) == 1);
  sim.free(b);
  sim.alloc.empty_cache();  // reserved back to 0: re-armed
  Block* c = sim.malloc(60 * MiB);
  REQUIRE(crossings(sim.alloc) == 2);
  sim.free(c);
}

TEST_CASE("mapping pages of a growable segment past the share counts a crossing", "[pressure]") {
  SimBackend backend(kDeviceBytes);
  backend.enable_virtual_memory(2 * MiB);
  DeviceAllocator alloc(backend, 0, config_with(100 * MiB));
  alloc.watch_pressure(0, 0.5);
  Block* a = alloc.malloc(40 * MiB, kStream0);
  REQUIRE(crossings(alloc) == 0);
  Block* b = alloc.malloc(20 * MiB, kStream0);
  REQUIRE(alloc.growable());
  REQUIRE(crossings(alloc) == 1);
  alloc.free(a);
  alloc.free(b);
}

TEST_CASE("memory the device refuses is no crossing", "[pressure][oom]") {
  Sim sim(100 * MiB);
  sim.alloc.watch_pressure(0, 0.5);
  sim.backend.fail_next(10);
  const Oom oom = oom_from([&] { sim.malloc(60 * MiB); });
  REQUIRE(oom.info.kind == OomKind::kDeviceFull);
  REQUIRE(crossings(sim.alloc) == 0);
  REQUIRE(sim.alloc.reserved() == 0);
}

TEST_CASE("each out-of-memory case has its counter, and they add up to num_ooms", "[pressure][oom][stats]") {
  Sim sim(100 * MiB);
  oom_from([&] { sim.malloc(200 * MiB); });  // over the limit
  sim.backend.fail_next(10);
  oom_from([&] { sim.malloc(10 * MiB); });  // device full
  const DeviceStats s = sim.stats();
  REQUIRE(s.num_ooms_over_limit == 1);
  REQUIRE(s.num_ooms_device_full == 1);
  REQUIRE(s.num_ooms_fragmentation == 0);
  REQUIRE(s.num_ooms == 2);
}

TEST_CASE("fragmentation counts as its own out-of-memory case", "[pressure][oom][stats]") {
  // Within the limit, but the free memory is the rest of a segment a live block holds: 10 MiB live
  // in a 40 MiB segment, a 35 MiB request against a 60 MiB limit.
  Sim sim(60 * MiB);
  sim.free(sim.malloc(40 * MiB));
  Block* live = sim.malloc(10 * MiB);
  const Oom oom = oom_from([&] { sim.malloc(35 * MiB); });
  REQUIRE(oom.info.kind == OomKind::kFragmentation);
  REQUIRE(sim.stats().num_ooms_fragmentation == 1);
  REQUIRE(sim.stats().num_ooms == 1);
  sim.free(live);
}

// ---- every device of a backend ----------------------------------------------------------------

TEST_CASE("no device is in use before one is used, and listing them counts none", "[pressure]") {
  CountingBackend backend(kDeviceBytes, 2);
  CachingAllocator core(backend);
  core.watch_pressure(0.5);
  REQUIRE(core.existing_devices().empty());
  REQUIRE(backend.device_counts == 0);
  core.device(1);
  const std::vector<DeviceAllocator*> in_use = core.existing_devices();
  REQUIRE(in_use.size() == 1);
  REQUIRE(in_use[0]->device() == 1);
}

TEST_CASE("a share watched before a device is made applies to it; the same share twice is one watch", "[pressure]") {
  SimBackend backend(kDeviceBytes, 2);
  CachingAllocator core(backend, config_with(100 * MiB));
  core.watch_pressure(0.5);
  core.device(0);
  core.watch_pressure(0.5);
  core.watch_pressure(0.9);
  void* p = core.raw_alloc(1, 95 * MiB, kStream0);
  REQUIRE(counts(core.device(0).cap().pressure()).size() == 2);
  const std::vector<PressureCount> c = counts(core.device(1).cap().pressure());
  REQUIRE(c.size() == 2);
  REQUIRE(c[0].share == 0.5);
  REQUIRE(c[0].crossings == 1);
  REQUIRE(c[1].share == 0.9);
  REQUIRE(c[1].crossings == 1);
  core.raw_free(p);
}

TEST_CASE("one share more than the watches hold is refused and changes nothing", "[pressure]") {
  SimBackend backend(kDeviceBytes);
  CachingAllocator core(backend);
  core.device(0);
  for (int i = 1; i <= kMaxPressureWatches; ++i) core.watch_pressure(i / 10.0);
  REQUIRE_THROWS_AS(core.watch_pressure(0.95), LimitSpecError);
  REQUIRE(counts(core.device(0).cap().pressure()).size() == static_cast<std::size_t>(kMaxPressureWatches));
  core.watch_pressure(0.1);  // one already watched is still fine
}
