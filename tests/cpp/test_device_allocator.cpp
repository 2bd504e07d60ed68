// DeviceAllocator's malloc as the chain of fallbacks described in device_allocator.h, the
// OutOfMemoryError that ends it, empty_cache, the read-only views (snapshot, segment_of), and the
// CachingAllocator that holds one DeviceAllocator per device.
#include <algorithm>
#include <memory>
#include <stdexcept>

#include "core/caching_allocator.h"
#include "helpers.h"

using namespace gpumem_test;

namespace {

std::vector<std::size_t> segment_sizes(const std::vector<SegmentInfo>& snapshot) {
  std::vector<std::size_t> sizes;
  for (const SegmentInfo& s : snapshot) sizes.push_back(s.size);
  std::sort(sizes.begin(), sizes.end());
  return sizes;
}

}  // namespace

// ---- 1. a cached block ------------------------------------------------------------------------

TEST_CASE("a cached free block is used before a new segment is reserved", "[fallback]") {
  Sim sim;
  Block* a = sim.malloc(5 * MiB);
  const std::uintptr_t a_addr = a->addr;
  sim.free(a);
  Block* b = sim.malloc(5 * MiB);
  REQUIRE(b->addr == a_addr);
  REQUIRE(sim.ledger().reserves == 1);
  REQUIRE(sim.stats().num_device_alloc == 1);
  REQUIRE(sim.stats().num_alloc_retries == 0);
}

// ---- 2. a new segment -------------------------------------------------------------------------

TEST_CASE("a new segment is reserved when no cached block fits", "[fallback]") {
  Sim sim;
  Block* a = sim.malloc(12 * MiB);
  sim.free(a);
  Block* b = sim.malloc(14 * MiB);
  REQUIRE(sim.segment_of(b).addr != sim.segment_of(a).addr);
  REQUIRE(sim.ledger().reserves == 2);
  REQUIRE(sim.ledger().releases == 0);  // under the limit nothing cached is given back
  REQUIRE(sim.ledger().in_use == 26 * MiB);
}

TEST_CASE("a tight segment is tried before any cached segment is released", "[fallback][cap]") {
  Sim sim(28 * MiB);
  Block* cached = sim.malloc(10 * MiB, kStream1);
  sim.free(cached);
  Block* b = sim.malloc(3 * MiB);  // 20 MiB would pass the limit; 4 MiB does not
  REQUIRE(sim.segment_of(b).size == 4 * MiB);
  REQUIRE(sim.ledger().releases == 0);
  REQUIRE(sim.stats().num_alloc_retries == 0);
  REQUIRE(sim.ledger().in_use == 14 * MiB);
}

// ---- 3. release by policy ---------------------------------------------------------------------

TEST_CASE("at the cap the smallest unused segment that covers the deficit is released", "[fallback][cap]") {
  Sim sim(47 * MiB);
  // Three unused segments, oldest first: 16, 12 and 14 MiB (42 MiB reserved).
  Block* s16 = sim.malloc(16 * MiB);
  Block* s12 = sim.malloc(12 * MiB);
  Block* s14 = sim.malloc(14 * MiB);
  const std::uintptr_t a16 = s16->addr, a12 = s12->addr, a14 = s14->addr;
  sim.free(s16);
  sim.free(s12);
  sim.free(s14);

  // 18 MiB needs a new segment; 5 MiB of headroom leaves a deficit of 13 MiB. 12 MiB is too
  // small, 16 MiB the oldest: the 14 MiB segment is the one to go.
  Block* b = sim.malloc(18 * MiB);
  REQUIRE(b->size == 18 * MiB);
  REQUIRE(segment_sizes(sim.snapshot()) == std::vector<std::size_t>{12 * MiB, 16 * MiB, 18 * MiB});
  REQUIRE(sim.has_segment_at(a16));
  REQUIRE(sim.has_segment_at(a12));
  REQUIRE(b->addr != a16);
  REQUIRE(b->addr != a12);
  (void)a14;
  REQUIRE(sim.ledger().releases == 1);
  REQUIRE(sim.ledger().in_use == 46 * MiB);
  REQUIRE(sim.ledger().peak <= 47 * MiB);
  REQUIRE(sim.stats().num_alloc_retries == 1);
  REQUIRE(sim.stats().num_cache_releases == 1);
  REQUIRE(sim.ledger().syncs == 0);
}

TEST_CASE("when no single unused segment covers the deficit the oldest go first", "[fallback][cap]") {
  Sim sim(40 * MiB);
  Block* s10 = sim.malloc(10 * MiB);
  Block* s12 = sim.malloc(12 * MiB);
  Block* s14 = sim.malloc(14 * MiB);
  const std::uintptr_t a10 = s10->addr, a12 = s12->addr, a14 = s14->addr;
  sim.free(s10);
  sim.free(s12);
  sim.free(s14);

  // 24 MiB with 4 MiB of headroom: a deficit of 20 MiB that no single segment covers.
  sim.malloc(24 * MiB);
  REQUIRE(segment_sizes(sim.snapshot()) == std::vector<std::size_t>{14 * MiB, 24 * MiB});
  REQUIRE(sim.has_segment_at(a14));
  (void)a10, (void)a12;
  REQUIRE(sim.ledger().releases == 2);
  REQUIRE(sim.ledger().in_use == 38 * MiB);
  REQUIRE(sim.ledger().peak <= 40 * MiB);
  REQUIRE(sim.stats().num_alloc_retries == 1);
}

TEST_CASE("the device is not synchronized while releasing cache suffices", "[fallback][streams]") {
  Sim sim(40 * MiB);
  Block* pending = sim.malloc(20 * MiB, kStream1);
  sim.alloc.record_stream(pending, kStream2);
  sim.free(pending);
  Block* cached = sim.malloc(20 * MiB, kStream3);
  const std::uintptr_t cached_addr = cached->addr;
  sim.free(cached);

  Block* b = sim.malloc(20 * MiB, kStream1);
  REQUIRE(sim.ledger().releases == 1);
  const auto snapshot = sim.snapshot();
  REQUIRE(snapshot.size() == 2);
  for (const SegmentInfo& s : snapshot) REQUIRE(s.stream == kStream1);  // the stream-3 segment went
  REQUIRE(b->addr == cached_addr);  // the device handed the released range out again
  REQUIRE(sim.ledger().syncs == 0);
  REQUIRE(sim.stats().num_sync_all_streams == 0);
  REQUIRE(sim.ledger().live_events == 1);  // the pending block still waits on its stream
}

// ---- 4. synchronize ---------------------------------------------------------------------------

TEST_CASE("when releasing cache is not enough the device is synchronized and pending blocks released",
          "[fallback][streams]") {
  Sim sim(20 * MiB);
  Block* a = sim.malloc(20 * MiB, kStream1);
  sim.alloc.record_stream(a, kStream2);
  sim.free(a);  // its event on stream 2 never completes on its own
  REQUIRE(sim.ledger().live_events == 1);

  Block* b = sim.malloc(20 * MiB, kStream1);
  REQUIRE(b->size == 20 * MiB);
  REQUIRE(sim.ledger().syncs == 1);
  REQUIRE(sim.stats().num_sync_all_streams == 1);
  REQUIRE(sim.stats().num_alloc_retries == 1);
  REQUIRE(sim.ledger().live_events == 0);
  REQUIRE(sim.ledger().releases == 1);  // the formerly pending segment went back to the device
  REQUIRE(sim.ledger().in_use == 20 * MiB);
  REQUIRE(sim.ledger().peak <= 20 * MiB);
}

// ---- 5. out of memory -------------------------------------------------------------------------

TEST_CASE("an OOM over the limit reports the request and the memory figures", "[oom][cap]") {
  Sim sim(40 * MiB);
  sim.malloc(30 * MiB);
  const Oom oom = oom_from([&] { sim.malloc(12 * MiB - 100); });
  REQUIRE(oom.info.kind == OomKind::kOverLimit);
  REQUIRE(oom.info.device == 0);
  REQUIRE(oom.info.requested == 12 * MiB - 100);
  REQUIRE(oom.info.allocated == 30 * MiB);
  REQUIRE(oom.info.reserved == 30 * MiB);
  REQUIRE(oom.info.limit == 40 * MiB);
  REQUIRE(oom.info.device_total == kDeviceBytes);
  REQUIRE(oom.info.device_free == kDeviceBytes - 30 * MiB);
  REQUIRE(oom.info.largest_free_block == 0);
}

TEST_CASE("the over-the-limit message names the case, the numbers and the setting", "[oom][cap]") {
  Sim sim(40 * MiB);
  sim.malloc(30 * MiB);
  const Oom oom = oom_from([&] { sim.malloc(12 * MiB); });
  REQUIRE_THAT(oom.message, Catch::StartsWith("CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has a total "
                                              "capacity of 8.00 GiB of which 7.97 GiB is free. 40.00 MiB allowed; "
                                              "Of the allocated memory 30.00 MiB is allocated by PyTorch, and 0 bytes "
                                              "is reserved by PyTorch but unallocated. gpumem: over the limit"));
  REQUIRE_THAT(oom.message, Catch::Contains("under a limit of 40.00 MiB"));
  REQUIRE_THAT(oom.message, Catch::Contains("set_limit"));
}

TEST_CASE("out-of-memory sizes are written as PyTorch writes them", "[oom]") {
  const auto tried = [](std::size_t requested) {
    OomInfo info;
    info.requested = requested;
    const std::string message = OutOfMemoryError(info).what();
    const auto from = message.find("allocate ") + 9;
    return message.substr(from, message.find(". GPU") - from);
  };
  REQUIRE(tried(1000) == "1000 bytes");
  REQUIRE(tried(1024) == "1024 bytes");
  REQUIRE(tried(1025) == "1.00 KiB");
  REQUIRE(tried(MiB) == "1024.00 KiB");
  REQUIRE(tried(20 * MiB) == "20.00 MiB");
  REQUIRE(tried(GiB) == "1024.00 MiB");
  REQUIRE(tried(800000000 * GiB) == "800000000.00 GiB");
  REQUIRE(tried(std::size_t{1} << 60) == "more than 1EB memory");
}

TEST_CASE("without a limit below the device's total the message names no allowed share", "[oom]") {
  OomInfo info;
  info.limit = info.device_total = 8 * GiB;
  REQUIRE_THAT(std::string(OutOfMemoryError(info).what()), !Catch::Contains("allowed;"));
}

TEST_CASE("an OOM over the limit releases nothing cached", "[oom][cap]") {
  Sim sim(40 * MiB);
  sim.malloc(30 * MiB);
  Block* cached = sim.malloc(10 * MiB, kStream1);
  sim.free(cached);
  const Oom oom = oom_from([&] { sim.malloc(12 * MiB); });
  REQUIRE(oom.info.kind == OomKind::kOverLimit);
  REQUIRE(oom.info.largest_free_block == 10 * MiB);
  REQUIRE(sim.ledger().releases == 0);
  REQUIRE(sim.ledger().in_use == 40 * MiB);
}

TEST_CASE("an OOM when another user holds the device memory is device full", "[oom]") {
  SimBackend backend(64 * MiB);
  DeviceAllocator other(backend, 0, config_with(std::nullopt));
  DeviceAllocator mine(backend, 0, config_with(32 * MiB));
  other.malloc(50 * MiB, kStream0);  // the device has 14 MiB left, under my 32 MiB limit

  const Oom oom = oom_from([&] { mine.malloc(20 * MiB, kStream0); });
  REQUIRE(oom.info.kind == OomKind::kDeviceFull);
  REQUIRE(oom.info.requested == 20 * MiB);
  REQUIRE(oom.info.allocated == 0);
  REQUIRE(oom.info.reserved == 0);
  REQUIRE(oom.info.limit == 32 * MiB);
  REQUIRE(oom.info.device_free == 14 * MiB);
  REQUIRE(oom.info.device_total == 64 * MiB);
  REQUIRE_THAT(oom.message, Catch::Contains("device full"));
  REQUIRE(mine.reserved() == 0);  // the refused bytes were given back to the cap
  REQUIRE(backend.ledger(0).refusals >= 1);
  mine.check_invariants();
}

TEST_CASE("an OOM when the device refuses every reserve is device full", "[oom]") {
  Sim sim(100 * MiB);
  sim.backend.fail_next(2);  // the new segment, then the retry after synchronizing
  const Oom oom = oom_from([&] { sim.malloc(4096); });
  REQUIRE(oom.info.kind == OomKind::kDeviceFull);
  REQUIRE_THAT(oom.message, Catch::Contains("device full"));
  REQUIRE(sim.ledger().refusals == 2);
  REQUIRE(sim.alloc.reserved() == 0);
  sim.alloc.check_invariants();
  REQUIRE(sim.malloc(4096)->size == 4096);
}

TEST_CASE("a device refusal releases unused segments and retries", "[fallback][oom]") {
  Sim sim;
  Block* cached = sim.malloc(20 * MiB, kStream1);
  sim.free(cached);
  sim.backend.fail_next(1);
  Block* b = sim.malloc(20 * MiB, kStream2);
  REQUIRE(b->size == 20 * MiB);
  REQUIRE(sim.ledger().releases == 1);
  REQUIRE(sim.snapshot().size() == 1);
  REQUIRE(sim.segment_of(b).stream == kStream2);
  REQUIRE(sim.ledger().refusals == 1);
  REQUIRE(sim.stats().num_cache_releases >= 1);
  REQUIRE(sim.ledger().in_use == 20 * MiB);
}

namespace {

// Two 20 MiB segments under a 40 MiB limit, each pinned by a live 2 MiB block, each with an
// 18 MiB free block: 4 MiB allocated, 36 MiB free, and no room for 20 MiB anywhere.
struct Fragmented {
  Sim sim{40 * MiB};
  Block* pin1 = nullptr;
  Block* pin2 = nullptr;

  Fragmented() {
    pin1 = sim.malloc(2 * MiB);
    Block* fill1 = sim.malloc(18 * MiB);
    pin2 = sim.malloc(2 * MiB);
    Block* fill2 = sim.malloc(18 * MiB);
    REQUIRE(sim.ledger().in_use == 40 * MiB);
    REQUIRE(sim.snapshot().size() == 2);
    sim.free(fill1);
    sim.free(fill2);
  }
};

}  // namespace

TEST_CASE("an OOM with room under the limit but no fitting segment is fragmentation", "[oom]") {
  Fragmented f;
  const Oom oom = oom_from([&] { f.sim.malloc(20 * MiB); });
  REQUIRE(oom.info.kind == OomKind::kFragmentation);
  REQUIRE(oom.info.requested == 20 * MiB);
  REQUIRE(oom.info.allocated == 4 * MiB);
  REQUIRE(oom.info.reserved == 40 * MiB);
  REQUIRE(oom.info.limit == 40 * MiB);
  REQUIRE(oom.info.largest_free_block == 18 * MiB);
  REQUIRE(oom.info.allocated + 20 * MiB <= oom.info.limit);
  REQUIRE_THAT(oom.message, Catch::Contains("fragmentation"));
  REQUIRE_THAT(oom.message, Catch::Contains("36.00 MiB is reserved by PyTorch but unallocated"));
  REQUIRE_THAT(oom.message, Catch::Contains("largest free cached block is 18.00 MiB"));
  REQUIRE(f.sim.ledger().in_use == 40 * MiB);
  REQUIRE(f.sim.ledger().peak <= 40 * MiB);
}

TEST_CASE("the device is not synchronized when nothing is pending", "[fallback][oom]") {
  Fragmented f;
  oom_from([&] { f.sim.malloc(20 * MiB); });  // runs the whole chain
  REQUIRE(f.sim.stats().num_alloc_retries == 1);
  REQUIRE(f.sim.ledger().syncs == 0);
  REQUIRE(f.sim.stats().num_sync_all_streams == 1);  // the pass is counted, as native counts it
}

TEST_CASE("each OOM increments num_ooms", "[oom][stats]") {
  Fragmented f;
  oom_from([&] { f.sim.malloc(20 * MiB); });
  REQUIRE(f.sim.stats().num_ooms == 1);
  oom_from([&] { f.sim.malloc(38 * MiB); });
  REQUIRE(f.sim.stats().num_ooms == 2);
}

TEST_CASE("the allocator works normally after an OOM", "[oom]") {
  Fragmented f;
  oom_from([&] { f.sim.malloc(20 * MiB); });
  f.sim.alloc.check_invariants();

  Block* small = f.sim.malloc(16 * MiB);  // an 18 MiB free block still serves this
  REQUIRE(f.sim.ledger().reserves == 2);
  const bool small_with_pin1 = f.sim.segment_of(small).addr == f.sim.segment_of(f.pin1).addr;
  Block* other_pin = small_with_pin1 ? f.pin2 : f.pin1;
  Block* same_pin = small_with_pin1 ? f.pin1 : f.pin2;
  f.sim.free(other_pin);  // its segment is one free 20 MiB block now
  Block* big = f.sim.malloc(20 * MiB);
  REQUIRE(big->size == 20 * MiB);
  REQUIRE(f.sim.ledger().in_use == 40 * MiB);
  REQUIRE(f.sim.ledger().peak <= 40 * MiB);
  f.sim.free(big);
  f.sim.free(small);
  f.sim.free(same_pin);
  REQUIRE(f.sim.stats().allocated_bytes[kAll].current == 0);
}

// ---- empty_cache ------------------------------------------------------------------------------

TEST_CASE("empty_cache returns every unused segment and keeps those with live blocks", "[empty_cache]") {
  Sim sim;
  Block* live_small = sim.malloc(4096);
  Block* live_large = sim.malloc(12 * MiB);
  Block* unused_small = sim.malloc(4096, kStream1);
  Block* unused_mid = sim.malloc(3 * MiB, kStream1);
  Block* unused_large = sim.malloc(30 * MiB, kStream1);
  Block* split_partner = sim.malloc(5 * MiB);  // a 20 MiB segment of its own, split until freed
  sim.free(unused_small);
  sim.free(unused_mid);
  sim.free(unused_large);
  sim.free(split_partner);
  REQUIRE(sim.ledger().in_use == 2 * MiB + 12 * MiB + 2 * MiB + 20 * MiB + 30 * MiB + 20 * MiB);

  sim.alloc.empty_cache();
  sim.alloc.check_invariants();
  const auto snapshot = sim.snapshot();
  REQUIRE(sim.ledger().in_use == bytes_of_segments_in_use(snapshot));
  REQUIRE(sim.ledger().in_use == 2 * MiB + 12 * MiB);
  REQUIRE(snapshot.size() == 2);
  REQUIRE(sim.ledger().releases == 4);
  REQUIRE(sim.stats().num_device_free == 4);
  REQUIRE(sim.alloc.reserved() == 14 * MiB);
  (void)live_small, (void)live_large;
}

TEST_CASE("empty_cache keeps a segment whose blocks are partly free", "[empty_cache]") {
  Sim sim;
  Block* a = sim.malloc(4096);
  Block* b = sim.malloc(4096);
  sim.free(a);
  sim.alloc.empty_cache();
  REQUIRE(sim.ledger().releases == 0);
  REQUIRE(sim.ledger().in_use == 2 * MiB);
  (void)b;
}

TEST_CASE("empty_cache synchronizes and returns segments freed with a pending stream use", "[empty_cache][streams]") {
  Sim sim;
  Block* a = sim.malloc(12 * MiB);
  sim.alloc.record_stream(a, kStream1);
  sim.free(a);
  sim.alloc.empty_cache();
  REQUIRE(sim.ledger().syncs == 1);
  REQUIRE(sim.stats().num_sync_all_streams == 1);
  REQUIRE(sim.ledger().in_use == 0);
  REQUIRE(sim.ledger().live_events == 0);
  REQUIRE(sim.snapshot().empty());
}

TEST_CASE("destroying the allocator returns every segment, live ones included", "[empty_cache]") {
  SimBackend backend(kDeviceBytes);
  {
    DeviceAllocator alloc(backend, 0, config_with(std::nullopt));
    alloc.malloc(4096, kStream0);
    Block* cached = alloc.malloc(12 * MiB, kStream0);
    alloc.free(cached);
    Block* pending = alloc.malloc(30 * MiB, kStream0);
    alloc.record_stream(pending, kStream1);
    alloc.free(pending);
    REQUIRE(backend.ledger(0).in_use == 44 * MiB);
  }
  REQUIRE(backend.ledger(0).in_use == 0);
  REQUIRE(backend.ledger(0).releases == 3);
  REQUIRE(backend.ledger(0).live_events == 0);
}

// ---- snapshot and segment_of ------------------------------------------------------------------

TEST_CASE("snapshot lists each segment with its blocks in address order", "[snapshot]") {
  Sim sim;
  Block* a = sim.malloc(1000, kStream1);
  Block* b = sim.malloc(3000, kStream1);
  Block* c = sim.malloc(5 * MiB, kStream2);
  sim.alloc.record_stream(b, kStream3);
  sim.free(b);

  const auto snapshot = sim.snapshot();
  REQUIRE(snapshot.size() == 2);
  const SegmentInfo& small = snapshot[0].small ? snapshot[0] : snapshot[1];
  const SegmentInfo& large = snapshot[0].small ? snapshot[1] : snapshot[0];
  REQUIRE(small.stream == kStream1);
  REQUIRE(small.pool.is_default());
  REQUIRE(small.size == 2 * MiB);
  REQUIRE(small.blocks.size() == 3);
  REQUIRE(small.blocks[0].addr == a->addr);
  REQUIRE(small.blocks[0].size == 1024);
  REQUIRE(small.blocks[0].requested == 1000);
  REQUIRE(small.blocks[0].state == BlockInfo::kAllocated);
  REQUIRE(small.blocks[1].size == 3072);
  REQUIRE(small.blocks[1].state == BlockInfo::kPendingFree);
  REQUIRE(small.blocks[2].addr == small.addr + 4096);
  REQUIRE(small.blocks[2].state == BlockInfo::kFree);
  REQUIRE(small.blocks[2].requested == 0);

  REQUIRE(large.stream == kStream2);
  REQUIRE_FALSE(large.small);
  REQUIRE(large.size == 20 * MiB);
  REQUIRE(large.blocks[0].addr == c->addr);
  REQUIRE(large.blocks[0].requested == 5 * MiB);
  REQUIRE(reserved_in_snapshot(snapshot) == sim.ledger().in_use);
}

TEST_CASE("snapshot is ordered by segment address", "[snapshot]") {
  Sim sim;
  for (StreamId s = 1; s <= 4; ++s) sim.malloc(4096, s);
  const auto snapshot = sim.snapshot();
  REQUIRE(snapshot.size() == 4);
  for (std::size_t i = 1; i < snapshot.size(); ++i) REQUIRE(snapshot[i - 1].addr < snapshot[i].addr);
}

TEST_CASE("segment_of finds the segment of any address inside it", "[snapshot]") {
  Sim sim;
  Block* a = sim.malloc(4096);
  Block* b = sim.malloc(4096);
  const SegmentInfo s = sim.segment_of(a);
  const auto expected = std::make_pair(s.addr, s.size);
  REQUIRE(sim.alloc.segment_of(a->ptr()) == expected);
  REQUIRE(sim.alloc.segment_of(b->ptr()) == expected);
  REQUIRE(sim.alloc.segment_of(reinterpret_cast<void*>(s.addr + s.size - 1)) == expected);
}

TEST_CASE("segment_of is empty outside every segment", "[snapshot]") {
  Sim sim;
  Block* a = sim.malloc(4096);
  const SegmentInfo s = sim.segment_of(a);
  REQUIRE_FALSE(sim.alloc.segment_of(reinterpret_cast<void*>(s.addr - 1)).has_value());
  REQUIRE_FALSE(sim.alloc.segment_of(reinterpret_cast<void*>(s.addr + s.size)).has_value());
  REQUIRE_FALSE(sim.alloc.segment_of(nullptr).has_value());
}

TEST_CASE("segment_of forgets a released segment", "[snapshot]") {
  Sim sim;
  Block* a = sim.malloc(4096);
  void* ptr = a->ptr();
  sim.free(a);
  REQUIRE(sim.alloc.segment_of(ptr).has_value());
  sim.alloc.empty_cache();
  REQUIRE_FALSE(sim.alloc.segment_of(ptr).has_value());
}

TEST_CASE("freeing a block twice throws and changes nothing", "[merge]") {
  Sim sim;
  Block* a = sim.malloc(4096);
  Block* keep = sim.malloc(4096);
  sim.free(a);
  const DeviceStats before = sim.stats();
  REQUIRE_THROWS_AS(sim.alloc.free(a), std::logic_error);
  sim.alloc.check_invariants();
  REQUIRE(sim.stats().allocated_bytes[kAll].current == before.allocated_bytes[kAll].current);
  (void)keep;
}

// ---- CachingAllocator -------------------------------------------------------------------------

TEST_CASE("device() of an index out of range throws DeviceError naming it and the range", "[caching_allocator]") {
  SimBackend backend(kDeviceBytes, 2);
  CachingAllocator ca(backend);
  REQUIRE(ca.device_count() == 2);
  REQUIRE_THROWS_AS(ca.device(2), DeviceError);
  REQUIRE_THROWS_WITH(ca.device(2), Catch::Contains("device 2") && Catch::Contains("0..1"));
  REQUIRE_THROWS_WITH(ca.device(-1), Catch::Contains("device -1") && Catch::Contains("0..1"));
  REQUIRE_THROWS_AS(ca.existing(5), DeviceError);
}

TEST_CASE("each device gets its own allocator on first use", "[caching_allocator]") {
  SimBackend backend(kDeviceBytes, 2);
  CachingAllocator ca(backend);
  REQUIRE(ca.existing(1) == nullptr);
  Block* b = ca.malloc(1, 4096, kStream0);
  REQUIRE(ca.existing(1) == &ca.device(1));
  REQUIRE(ca.existing(0) == nullptr);
  REQUIRE(ca.device(1).device() == 1);
  REQUIRE(backend.ledger(1).in_use == 2 * MiB);
  REQUIRE(backend.ledger(0).in_use == 0);
  CachingAllocator::free(b);
  REQUIRE(ca.device(1).stats().allocated_bytes[kAll].current == 0);
}

TEST_CASE("raw_alloc hands out an address that raw_free gives back", "[caching_allocator]") {
  SimBackend backend(kDeviceBytes);
  CachingAllocator ca(backend);
  void* p = ca.raw_alloc(0, 5000, kStream0);
  REQUIRE(p != nullptr);
  Block* b = ca.find_raw(p);
  REQUIRE(b != nullptr);
  REQUIRE(b->ptr() == p);
  REQUIRE(b->requested == 5000);
  REQUIRE(ca.device(0).stats().allocated_bytes[kAll].current == 5120);

  ca.raw_free(p);
  REQUIRE(ca.find_raw(p) == nullptr);
  REQUIRE(ca.device(0).stats().allocated_bytes[kAll].current == 0);
  ca.device(0).check_invariants();
}

TEST_CASE("take_raw forgets the address and leaves its block allocated", "[caching_allocator]") {
  SimBackend backend(kDeviceBytes);
  CachingAllocator ca(backend);
  void* p = ca.raw_alloc(0, 4096, kStream0);
  int local = 0;
  REQUIRE(ca.take_raw(&local) == nullptr);
  Block* b = ca.take_raw(p);
  REQUIRE(b != nullptr);
  REQUIRE(b->ptr() == p);
  REQUIRE(b->allocated);
  REQUIRE(ca.find_raw(p) == nullptr);
  REQUIRE(ca.take_raw(p) == nullptr);
  CachingAllocator::free(b);
  REQUIRE(ca.device(0).stats().allocated_bytes[kAll].current == 0);
  ca.device(0).check_invariants();
}

TEST_CASE("raw_free of an address raw_alloc did not hand out throws", "[caching_allocator]") {
  SimBackend backend(kDeviceBytes);
  CachingAllocator ca(backend);
  void* p = ca.raw_alloc(0, 4096, kStream0);
  int local = 0;
  REQUIRE_THROWS_AS(ca.raw_free(&local), std::invalid_argument);
  REQUIRE_THROWS_AS(ca.raw_free(static_cast<char*>(p) + 512), std::invalid_argument);
  ca.raw_free(p);
  REQUIRE_THROWS_AS(ca.raw_free(p), std::invalid_argument);  // a second free of the same address
  REQUIRE(ca.device(0).stats().allocated_bytes[kAll].current == 0);
  ca.device(0).check_invariants();
}

TEST_CASE("configure before first use sets the device's limit", "[caching_allocator][limit]") {
  SimBackend backend(kDeviceBytes, 2);
  CachingAllocator ca(backend);
  ca.configure(1, config_with(64 * MiB, 0.5));
  REQUIRE(ca.device(1).limit() == 64 * MiB);
  REQUIRE(ca.device(1).release_threshold() == 0.5);
  REQUIRE(ca.device(0).limit() == kDeviceBytes);
  REQUIRE_THROWS_AS(ca.malloc(1, 65 * MiB, kStream0), OutOfMemoryError);
}

TEST_CASE("configure after first use applies the limit at once", "[caching_allocator][limit]") {
  SimBackend backend(kDeviceBytes, 1);
  CachingAllocator ca(backend);
  Block* a = ca.malloc(0, 20 * MiB, kStream0);
  CachingAllocator::free(a);  // 20 MiB cached
  ca.configure(0, config_with(4 * MiB));
  REQUIRE(ca.device(0).limit() == 4 * MiB);
  REQUIRE(backend.ledger(0).in_use == 0);  // the lowered limit released the cache
  REQUIRE_THROWS_AS(ca.configure(0, config_with(8 * MiB, 2.0)), LimitSpecError);
  REQUIRE(ca.device(0).limit() == 4 * MiB);  // a bad threshold changed nothing
}

TEST_CASE("the defaults given to CachingAllocator apply to every device", "[caching_allocator][limit]") {
  SimBackend backend(kDeviceBytes, 2);
  CachingAllocator ca(backend, config_with(32 * MiB));
  REQUIRE(ca.device(0).limit() == 32 * MiB);
  REQUIRE(ca.device(1).limit() == 32 * MiB);
}

TEST_CASE("configure of a device out of range throws DeviceError", "[caching_allocator]") {
  SimBackend backend(kDeviceBytes, 2);
  CachingAllocator ca(backend);
  REQUIRE_THROWS_AS(ca.configure(2, config_with(MiB)), DeviceError);
}

namespace {

// A device whose releases fail, as a driver can at process exit.
struct FailingRelease final : SimBackend {
  using SimBackend::SimBackend;
  void release(int, void*, std::size_t) override { throw std::runtime_error("driver shut down"); }
  void release_address(int, void*, std::size_t) override { throw std::runtime_error("driver shut down"); }
};

}  // namespace

TEST_CASE("the destructor does not throw when the device refuses to take memory back", "[allocator]") {
  const auto page = GENERATE(std::size_t{0}, 2 * MiB);
  FailingRelease backend(kDeviceBytes);
  if (page > 0) backend.enable_virtual_memory(page);
  auto allocator = std::make_unique<DeviceAllocator>(backend, 0, config_with(std::nullopt));
  allocator->malloc(3 * MiB, kStream0);
  allocator->malloc(100, kStream0);
  REQUIRE_NOTHROW(allocator.reset());
}

namespace {

// A device that hands out the same address twice, as a broken driver could.
struct RepeatingBackend final : SimBackend {
  using SimBackend::SimBackend;
  void* first = nullptr;
  void* reserve(int device, std::size_t bytes) override {
    void* ptr = SimBackend::reserve(device, bytes);
    if (!first) first = ptr;
    return ptr ? first : nullptr;
  }
};

}  // namespace

TEST_CASE("a device that hands out memory the allocator holds fails the request, not the process", "[allocator]") {
  RepeatingBackend backend(kDeviceBytes);
  auto allocator = std::make_unique<DeviceAllocator>(backend, 0, config_with(std::nullopt));
  allocator->malloc(3 * MiB, kStream0);
  const std::size_t reserved = allocator->reserved();
  REQUIRE_THROWS_WITH(allocator->malloc(3 * MiB, kStream1), Catch::Contains("overlap memory the allocator already holds"));
  REQUIRE(allocator->reserved() == reserved);
  allocator->check_invariants();
  REQUIRE_NOTHROW(allocator.reset());
}
