// Regions paused and resumed (core/pause.cpp) on the simulated device with virtual memory: a
// region's memory, live blocks included, goes back to the device and comes back at the same
// addresses, its contents restored from a backup where one was asked for, under the cap.
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "helpers.h"

using namespace gpumem_test;

namespace {

constexpr PoolId kRegion{std::uint64_t{1} << 62, 1};

bool all_streams(StreamId) { return true; }

// Blocks allocated in the region `id` on stream 0.
Block* in_region(Sim& sim, std::size_t bytes, PoolId id = kRegion) {
  sim.alloc.begin_allocate_to_pool(id, all_streams);
  Block* block = sim.malloc(bytes);
  sim.alloc.end_allocate_to_pool(id);
  return block;
}

std::size_t allocated(const Sim& sim) {
  return static_cast<std::size_t>(sim.stats().allocated_bytes[kAll].current);
}

std::size_t stats_reserved(const Sim& sim) {
  return static_cast<std::size_t>(sim.stats().reserved_bytes[kAll].current);
}

// Frees `blocks` and empties the cache: the device then holds nothing of the allocator's.
void free_all(Sim& sim, std::initializer_list<Block*> blocks) {
  for (Block* b : blocks) sim.free(b);
  sim.alloc.empty_cache();
  REQUIRE(sim.ledger().mapped == 0);
}

template <class Error, class Call>
std::string error_from(Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  FAIL("expected an error");
  return {};
}

}  // namespace

TEST_CASE("a region's memory comes from growable segments even where the process's default is plain", "[pause]") {
  VmSim sim(std::nullopt, /*growable=*/false);
  sim.alloc.create_region(kRegion);
  Block* r = in_region(sim, 5 * MiB);
  REQUIRE(r->segment->growable);
  REQUIRE(r->segment->pool->region());
  Block* d = sim.malloc(5 * MiB);
  REQUIRE_FALSE(d->segment->growable);  // the default pool keeps plain segments
}

TEST_CASE("a region refuses where the device cannot map pages, and a region's pool is its own", "[pause]") {
  Sim plain;  // no virtual memory
  REQUIRE_THAT(error_from<std::invalid_argument>([&] { plain.alloc.create_region(kRegion); }),
               Catch::Matchers::Contains("cannot map pages"));
  VmSim sim;
  sim.alloc.create_region(kRegion);
  REQUIRE_THROWS_AS(sim.alloc.create_region(kRegion), std::invalid_argument);
  sim.alloc.create_pool(PoolId{1, 1});
  REQUIRE_THROWS_AS(sim.alloc.create_region(PoolId{1, 1}), std::invalid_argument);
  REQUIRE(sim.alloc.pool_use_count(PoolId{1, 1}) == 1);  // the refusal took no holder
  REQUIRE_THROWS_AS(sim.alloc.pause(PoolId{1, 1}, false), std::invalid_argument);  // not a region
  REQUIRE_THROWS_AS(sim.alloc.pause(PoolId{7, 7}, false), std::invalid_argument);  // no pool
}

TEST_CASE("pause gives back a region's live and cached memory; resume maps it at the same addresses and restores it", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 10 * MiB);
  Block* b = in_region(sim, 30 * MiB);
  Block* c = in_region(sim, 8 * MiB);
  Block* outside = sim.malloc(4 * MiB);  // the default pool's: stays
  sim.free(b);                           // the region's cache
  const std::uintptr_t a_addr = a->addr, c_addr = c->addr;
  sim.backend.write(0, a_addr, 0xA);
  sim.backend.write(0, c_addr + 6 * MiB, 0xC);
  const std::size_t live = a->size + c->size;
  const std::size_t syncs = sim.ledger().syncs;

  const std::size_t paused = sim.alloc.pause(kRegion, /*backup=*/true);
  sim.alloc.check_invariants();
  REQUIRE(sim.ledger().syncs == syncs + 1);  // the device's queued work waited for
  REQUIRE(paused >= live);
  REQUIRE(paused < live + 2 * kSimPage);  // the pages the live blocks lie on; the cache went back
  REQUIRE(sim.ledger().mapped == outside->segment->mapped());  // only the default pool's memory is mapped
  REQUIRE(sim.alloc.reserved() == outside->segment->mapped());
  REQUIRE(stats_reserved(sim) == sim.alloc.reserved());
  REQUIRE(allocated(sim) == live + outside->size);  // the tensors still exist
  REQUIRE(sim.alloc.paused_bytes() == paused);
  REQUIRE(sim.alloc.paused_allocated() == live);
  REQUIRE(sim.ledger().backed_up == paused);
  REQUIRE_FALSE(sim.backend.is_mapped(0, a_addr));
  REQUIRE(sim.alloc.pause(kRegion, true) == 0);  // paused already: nothing more

  REQUIRE(sim.alloc.resume(kRegion) == paused);
  sim.alloc.check_invariants();
  REQUIRE(a->addr == a_addr);
  REQUIRE(c->addr == c_addr);
  REQUIRE(sim.backend.read(0, a_addr) == std::optional<std::uint64_t>{0xA});
  REQUIRE(sim.backend.read(0, c_addr + 6 * MiB) == std::optional<std::uint64_t>{0xC});
  REQUIRE(sim.alloc.reserved() == paused + outside->segment->mapped());
  REQUIRE(sim.alloc.paused_bytes() == 0);
  REQUIRE(sim.alloc.paused_allocated() == 0);
  REQUIRE(sim.ledger().host_held == paused);  // the backup kept for the next pause
  REQUIRE(sim.alloc.resume(kRegion) == 0);  // not paused: nothing

  // The next pause of the same chunks reuses the kept backup, with the contents of now.
  sim.backend.write(0, a_addr, 0xAA);
  REQUIRE(sim.alloc.pause(kRegion, true) == paused);
  REQUIRE(sim.ledger().host_held == paused);
  REQUIRE(sim.ledger().backed_up == 2 * paused);
  REQUIRE(sim.alloc.drop_backup(kRegion) == 0);  // paused: its backup is what resume restores
  sim.alloc.resume(kRegion);
  REQUIRE(sim.backend.read(0, a_addr) == std::optional<std::uint64_t>{0xAA});
  REQUIRE(sim.alloc.drop_backup(kRegion) == paused);
  REQUIRE(sim.ledger().host_held == 0);
  sim.free(a);
  sim.free(c);
  sim.free(outside);
}

TEST_CASE("a pause of other chunks than the kept backup's frees it and backs up anew", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 10 * MiB);
  const std::size_t first = sim.alloc.pause(kRegion, true);
  sim.alloc.resume(kRegion);
  Block* b = in_region(sim, 30 * MiB);  // the region grew
  sim.backend.write(0, b->addr, 9);
  const std::size_t second = sim.alloc.pause(kRegion, true);
  REQUIRE(second > first);
  REQUIRE(sim.ledger().host_held == second);  // the old copy went, the new one is whole
  sim.alloc.resume(kRegion);
  REQUIRE(sim.backend.read(0, b->addr) == std::optional<std::uint64_t>{9});
  sim.free(a);
  sim.free(b);
}

TEST_CASE("without a backup, a resumed region has its memory back but not its contents", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 10 * MiB);
  sim.backend.write(0, a->addr, 7);
  sim.alloc.pause(kRegion, /*backup=*/false);
  REQUIRE(sim.ledger().backed_up == 0);
  sim.alloc.resume(kRegion);
  REQUIRE(sim.backend.is_mapped(0, a->addr));
  REQUIRE_FALSE(sim.backend.read(0, a->addr).has_value());
  sim.free(a);
}

TEST_CASE("a paused region's memory is the process's to use; a resume the cap cannot hold fails and changes nothing", "[pause]") {
  VmSim sim(64 * MiB);
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 40 * MiB);
  sim.backend.write(0, a->addr, 42);
  REQUIRE_THROWS_AS(sim.malloc(40 * MiB), OutOfMemoryError);  // the region holds the cap
  const std::size_t paused = sim.alloc.pause(kRegion, true);
  Block* other = sim.malloc(40 * MiB);  // the cap counts the paused memory as not reserved
  const std::size_t reserved = sim.alloc.reserved();
  const std::size_t mapped = sim.ledger().mapped;

  const Oom oom = oom_from([&] { sim.alloc.resume(kRegion); });
  sim.alloc.check_invariants();
  REQUIRE(oom.info.kind == OomKind::kOverLimit);
  REQUIRE(oom.info.resuming == paused);
  REQUIRE_THAT(oom.message, Catch::Matchers::StartsWith("gpumem: resuming a paused region needs its 40.00 MiB paused"));
  REQUIRE_THAT(oom.message, Catch::Matchers::Contains("it stays paused"));
  REQUIRE(sim.alloc.paused_bytes() == paused);  // still paused, nothing else changed
  REQUIRE(sim.alloc.reserved() == reserved);
  REQUIRE(sim.ledger().mapped == mapped);
  REQUIRE(sim.ledger().host_held == paused);  // the backup kept

  sim.free(other);
  sim.alloc.empty_cache();
  REQUIRE(sim.alloc.resume(kRegion) == paused);
  REQUIRE(sim.backend.read(0, a->addr) == std::optional<std::uint64_t>{42});
  sim.free(a);
}

TEST_CASE("a resume gives back the process's cache where the cap needs it, as a growth does", "[pause]") {
  VmSim sim(64 * MiB);
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 40 * MiB);
  const std::size_t paused = sim.alloc.pause(kRegion, true);
  sim.free(sim.malloc(40 * MiB));  // the memory the region gave back, cached by the default pool now
  REQUIRE(sim.alloc.reserved() >= 40 * MiB);
  REQUIRE(sim.alloc.resume(kRegion) == paused);
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() <= 64 * MiB);
  sim.free(a);
}

TEST_CASE("resuming while a pool is the allocation target is refused, the region still paused", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 10 * MiB);
  sim.alloc.pause(kRegion, false);
  sim.alloc.create_pool(PoolId{1, 1});
  sim.alloc.begin_allocate_to_pool(PoolId{1, 1}, all_streams);
  REQUIRE_THAT(error_from<std::logic_error>([&] { sim.alloc.resume(kRegion); }), Catch::Matchers::Contains("resume after it ends"));
  sim.alloc.end_allocate_to_pool(PoolId{1, 1});
  REQUIRE(sim.alloc.paused_bytes() > 0);
  REQUIRE(sim.alloc.resume(kRegion) > 0);
  sim.free(a);
}

TEST_CASE("a resume on a full device fails as device full, the region still paused, and succeeds once memory is back", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 100 * MiB);
  sim.backend.write(0, a->addr + 50 * MiB, 5);
  const std::size_t paused = sim.alloc.pause(kRegion, true);
  sim.backend.set_use_outside(0, 0, kDeviceBytes - 50 * MiB);  // another process takes the memory
  const Oom oom = oom_from([&] { sim.alloc.resume(kRegion); });
  sim.alloc.check_invariants();
  REQUIRE(oom.info.kind == OomKind::kDeviceFull);
  REQUIRE(oom.info.resuming == paused);
  REQUIRE(sim.alloc.paused_bytes() == paused);
  REQUIRE(sim.ledger().mapped == 0);
  sim.backend.set_use_outside(0, 0, 0);
  REQUIRE(sim.alloc.resume(kRegion) == paused);
  REQUIRE(sim.backend.read(0, a->addr + 50 * MiB) == std::optional<std::uint64_t>{5});
  sim.free(a);
}

TEST_CASE("a paused region refuses allocations, frees its tensors, and is left alone by empty_cache", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 10 * MiB);
  Block* b = in_region(sim, 20 * MiB);
  sim.alloc.pause(kRegion, false);
  sim.alloc.begin_allocate_to_pool(kRegion, all_streams);
  REQUIRE_THAT(error_from<std::runtime_error>([&] { sim.alloc.malloc(MiB, kStream0); }),
               Catch::Matchers::Contains("paused region"));
  sim.alloc.end_allocate_to_pool(kRegion);
  sim.free(a);  // freeing a paused tensor is fine
  REQUIRE(sim.alloc.paused_allocated() == b->size);
  REQUIRE(allocated(sim) == b->size);
  sim.alloc.empty_cache();  // nothing of the paused region is unmapped again or dropped
  sim.alloc.check_invariants();
  const std::size_t paused = sim.alloc.paused_bytes();
  REQUIRE(sim.alloc.resume(kRegion) == paused);
  REQUIRE(sim.alloc.paused_allocated() == 0);
  sim.alloc.empty_cache();  // what was freed while paused is cache now, and goes
  REQUIRE(sim.alloc.reserved() < b->size + 2 * kSimPage);
  free_all(sim, {b});
}

TEST_CASE("a paused tensor used on another stream and freed waits for that stream, and resume counts it freed", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 10 * MiB);
  Block* b = in_region(sim, 10 * MiB);
  sim.alloc.record_stream(a, kStream1);
  sim.alloc.pause(kRegion, false);
  sim.free(a);  // pending on stream 1's work
  REQUIRE(sim.alloc.paused_allocated() == b->size);
  sim.alloc.resume(kRegion);
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.paused_allocated() == 0);
  REQUIRE(allocated(sim) == b->size);
  sim.backend.complete_events();
  free_all(sim, {b});
}

TEST_CASE("pausing while a pool is the allocation target is refused, changing nothing", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 10 * MiB);
  sim.alloc.begin_allocate_to_pool(kRegion, all_streams);
  REQUIRE_THAT(error_from<std::logic_error>([&] { sim.alloc.pause(kRegion, false); }),
               Catch::Matchers::Contains("pause after it ends"));
  sim.alloc.end_allocate_to_pool(kRegion);
  REQUIRE(sim.alloc.paused_bytes() == 0);
  REQUIRE(sim.backend.is_mapped(0, a->addr));
  sim.free(a);
}

TEST_CASE("an allocator destroyed while a region is paused gives back its address ranges and backups", "[pause]") {
  SimBackend backend(kDeviceBytes);
  backend.enable_virtual_memory(kSimPage);
  {
    DeviceAllocator alloc(backend, 0, AllocatorConfig{});
    alloc.create_region(kRegion);
    alloc.begin_allocate_to_pool(kRegion, all_streams);
    alloc.malloc(10 * MiB, kStream0);
    alloc.end_allocate_to_pool(kRegion);
    alloc.pause(kRegion, true);
    REQUIRE(backend.ledger(0).host_held > 0);
  }
  REQUIRE(backend.ledger(0).address_ranges == 0);
  REQUIRE(backend.ledger(0).mapped == 0);
  REQUIRE(backend.ledger(0).host_held == 0);
}

TEST_CASE("prepare_backup holds host memory for every mapped chunk of a region, and the next pause copies into it", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 10 * MiB);
  Block* b = in_region(sim, 30 * MiB);
  sim.free(b);  // the region's cache: prepared for too, the pause then gives it back
  sim.backend.write(0, a->addr + 8 * MiB, 3);
  const std::size_t mapped = a->segment->mapped();

  REQUIRE(sim.alloc.prepare_backup(kRegion) == mapped);
  REQUIRE(sim.ledger().host_held == mapped);
  REQUIRE(sim.ledger().backed_up == 0);  // nothing copied yet
  REQUIRE(sim.alloc.prepare_backup(kRegion) == 0);  // held already

  const std::size_t paused = sim.alloc.pause(kRegion, true);
  REQUIRE(paused < mapped);
  REQUIRE(sim.ledger().backed_up == paused);
  REQUIRE(sim.ledger().host_held == mapped);  // no new host memory: the run lies inside the prepared one
  REQUIRE(sim.alloc.prepare_backup(kRegion) == 0);  // paused: its backup holds the contents
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.resume(kRegion) == paused);
  REQUIRE(sim.backend.read(0, a->addr + 8 * MiB) == std::optional<std::uint64_t>{3});
  REQUIRE(sim.alloc.drop_backup(kRegion) == mapped);
  REQUIRE(sim.ledger().host_held == 0);
  sim.free(a);
}

TEST_CASE("prepare_backup frees held memory that no longer matches the region's chunks and holds them anew", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 10 * MiB);
  const std::size_t first = sim.alloc.prepare_backup(kRegion);
  REQUIRE(first == a->segment->mapped());
  Block* b = in_region(sim, 20 * MiB);  // the region grew beyond what was prepared
  const std::size_t now = a->segment->mapped() + (b->segment == a->segment ? 0 : b->segment->mapped());
  REQUIRE(now > first);
  const std::size_t pinned = sim.alloc.prepare_backup(kRegion);
  REQUIRE(pinned == (b->segment == a->segment ? now : now - first));  // one longer run, or a run of its own
  REQUIRE(sim.ledger().host_held == now);  // what covers the chunks now, and nothing else
  sim.backend.write(0, b->addr, 4);
  const std::size_t backed = sim.ledger().backed_up;
  sim.alloc.pause(kRegion, true);
  REQUIRE(sim.ledger().host_held == now);
  sim.alloc.resume(kRegion);
  REQUIRE(sim.ledger().backed_up > backed);
  REQUIRE(sim.backend.read(0, b->addr) == std::optional<std::uint64_t>{4});
  sim.free(a);
  sim.free(b);
}

TEST_CASE("prepare_backup of a region with nothing mapped pins nothing", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  REQUIRE(sim.alloc.prepare_backup(kRegion) == 0);
  REQUIRE(sim.ledger().host_held == 0);
  REQUIRE_THROWS_AS(sim.alloc.prepare_backup(PoolId{7, 7}), std::invalid_argument);  // no pool
}

TEST_CASE("a pause copies a run at its offset inside held memory; a run reaching past held memory frees it", "[pause]") {
  VmSim sim;
  sim.alloc.create_region(kRegion);
  Block* a = in_region(sim, 4 * MiB);
  Block* b = in_region(sim, 16 * MiB);
  Block* c = in_region(sim, 4 * MiB);
  REQUIRE(c->addr == a->addr + 20 * MiB);  // one run: a, b, c
  sim.free(b);
  const std::size_t prepared = sim.alloc.prepare_backup(kRegion);
  REQUIRE(prepared == 24 * MiB);
  sim.backend.write(0, c->addr, 8);

  // b's chunks go at the pause: two runs, c's 20 MiB into the held memory.
  REQUIRE(sim.alloc.pause(kRegion, true) == 8 * MiB);
  REQUIRE(sim.ledger().host_held == prepared);
  sim.alloc.resume(kRegion);
  REQUIRE(sim.backend.read(0, c->addr) == std::optional<std::uint64_t>{8});

  // d lies past c, in a run (c, d) reaching past the held memory: that run gets memory of its own,
  // and the held memory, overlapped, goes with a's run in it (which gets its own too).
  Block* d = in_region(sim, 20 * MiB);
  REQUIRE(d->addr == c->addr + 4 * MiB);
  sim.backend.write(0, d->addr, 9);
  const std::size_t paused = sim.alloc.pause(kRegion, true);
  REQUIRE(paused == 28 * MiB);
  REQUIRE(sim.ledger().host_held == paused);  // disjoint: no byte held twice
  sim.alloc.check_invariants();
  sim.alloc.resume(kRegion);
  REQUIRE(sim.backend.read(0, c->addr) == std::optional<std::uint64_t>{8});
  REQUIRE(sim.backend.read(0, d->addr) == std::optional<std::uint64_t>{9});
  for (Block* block : {a, c, d}) sim.free(block);
}

namespace {

// A simulated device on which something happens while a backup's host memory is being allocated:
// the allocator holds no lock then, so another call runs.
class MeanwhileBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::function<void()> meanwhile;
  void allocate_backup(int device, std::vector<HostCopy>& copies) override {
    if (meanwhile) std::exchange(meanwhile, nullptr)();
    ForwardingBackend::allocate_backup(device, copies);
  }
};

// A region holding one block of 10 MiB, on a MeanwhileBackend.
struct MeanwhileRegion {
  SimBackend sim{kDeviceBytes};
  MeanwhileBackend backend{Sim::with_pages(sim, kSimPage)};
  DeviceAllocator alloc{backend, 0, AllocatorConfig{}};
  Block* block = nullptr;

  MeanwhileRegion() {
    alloc.create_region(kRegion);
    alloc.begin_allocate_to_pool(kRegion, all_streams);
    block = alloc.malloc(10 * MiB, kStream0);
    alloc.end_allocate_to_pool(kRegion);
  }
  ~MeanwhileRegion() { alloc.free(block); }
};

}  // namespace

TEST_CASE("a prepare overtaken by a pause keeps none of the memory that pause backed up", "[pause]") {
  MeanwhileRegion r;
  r.sim.write(0, r.block->addr, 6);
  std::size_t paused = 0;
  r.backend.meanwhile = [&] { paused = r.alloc.pause(kRegion, true); };

  REQUIRE(r.alloc.prepare_backup(kRegion) == 0);  // the pause's own backup covers the same chunks
  REQUIRE(paused > 0);
  REQUIRE(r.sim.ledger(0).host_held == paused);  // the prepared memory went
  r.alloc.check_invariants();
  REQUIRE(r.alloc.resume(kRegion) == paused);
  REQUIRE(r.sim.read(0, r.block->addr) == std::optional<std::uint64_t>{6});
}

TEST_CASE("a prepare whose host memory cannot be had raises and leaves the region as it was", "[pause]") {
  MeanwhileRegion r;
  r.backend.meanwhile = [] { throw std::runtime_error("gpumem: no host memory"); };
  REQUIRE_THROWS_WITH(r.alloc.prepare_backup(kRegion), "gpumem: no host memory");
  REQUIRE(r.sim.ledger(0).host_held == 0);
  const std::size_t paused = r.alloc.pause(kRegion, true);  // backs up as if never prepared
  REQUIRE(r.sim.ledger(0).host_held == paused);
  r.alloc.resume(kRegion);
}
