// The cached path of each stream in its own lane (core/lanes.h): the statistics stay exact, peaks
// included, though lanes run without the whole device; every Block stays with its home arena, so
// no loop grows host memory; streams past the slots still work under the whole device.
//
// These tests call the allocator directly, not through Sim's checked malloc and free: a check takes
// the whole device, and the point here is what the lanes do on their own.
#include <algorithm>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "helpers.h"

using namespace gpumem_test;

namespace {

using I = std::int64_t;

// What the test itself counts of three figures: current and peak, of all pools.
struct Model {
  I allocation = 0, allocation_peak = 0;
  I bytes = 0, bytes_peak = 0;
  I requested = 0, requested_peak = 0;

  void hand_out(const Block* b, std::size_t requested_size) {
    allocation += 1;
    bytes += static_cast<I>(b->size);
    requested += static_cast<I>(requested_size);
    allocation_peak = std::max(allocation_peak, allocation);
    bytes_peak = std::max(bytes_peak, bytes);
    requested_peak = std::max(requested_peak, requested);
  }
  void free(const Block* b, std::size_t requested_size) {
    allocation -= 1;
    bytes -= static_cast<I>(b->size);
    requested -= static_cast<I>(requested_size);
  }
  void reset_peak() {
    allocation_peak = allocation;
    bytes_peak = bytes;
    requested_peak = requested;
  }
};

void require_matches(const DeviceStats& s, const Model& m) {
  REQUIRE(s.allocation[kAll].current == m.allocation);
  REQUIRE(s.allocation[kAll].peak == m.allocation_peak);
  REQUIRE(s.allocated_bytes[kAll].current == m.bytes);
  REQUIRE(s.allocated_bytes[kAll].peak == m.bytes_peak);
  REQUIRE(s.requested_bytes[kAll].current == m.requested);
  REQUIRE(s.requested_bytes[kAll].peak == m.requested_peak);
  REQUIRE(s.active[kAll].peak == m.allocation_peak);  // no block pends here: active is allocation
}

struct Live {
  Block* block;
  std::size_t requested;
};

// Leaves 64 MiB cached on each of streams 1 and 2 after a peak of 64 MiB (one held at a time), and
// returns that peak.
I cache_64_mib_on_two_streams(Sim& sim) {
  Block* a = sim.alloc.malloc(64 * MiB, kStream1);
  const I peak = static_cast<I>(a->size);
  sim.alloc.free(a);
  sim.alloc.free(sim.alloc.malloc(64 * MiB, kStream2));
  REQUIRE(sim.stats().allocated_bytes[kAll].peak == peak);
  return peak;
}

}  // namespace

TEST_CASE("cached mallocs on two streams under the peak leave it, and the one past it moves it exactly",
          "[lanes][stats]") {
  Sim sim;
  const I peak = cache_64_mib_on_two_streams(sim);
  const std::size_t reserved = sim.ledger().in_use;
  Block* x1 = sim.alloc.malloc(16 * MiB, kStream1);  // from the cache, each in its stream's lane
  Block* x2 = sim.alloc.malloc(16 * MiB, kStream2);
  const I held = static_cast<I>(x1->size + x2->size);
  REQUIRE(held < peak);
  DeviceStats s = sim.stats();
  REQUIRE(s.allocated_bytes[kAll].current == held);
  REQUIRE(s.allocated_bytes[kAll].peak == peak);
  REQUIRE(s.allocation[kAll].peak == 2);
  Block* y1 = sim.alloc.malloc(40 * MiB, kStream1);  // the whole passes the old peak
  REQUIRE(sim.ledger().in_use == reserved);         // all of it was cached memory
  s = sim.stats();
  const I now = held + static_cast<I>(y1->size);
  REQUIRE(now > peak);
  REQUIRE(s.allocated_bytes[kAll].current == now);
  REQUIRE(s.allocated_bytes[kAll].peak == now);
  REQUIRE(s.allocation[kAll].peak == 3);
  for (Block* blk : {x1, x2, y1}) sim.alloc.free(blk);
  REQUIRE(sim.stats().allocated_bytes[kAll].peak == now);
  sim.alloc.check_invariants();
}

TEST_CASE("two streams whose cached mallocs together pass the peak move it exactly, with no other call between",
          "[lanes][stats]") {
  Sim sim;
  const I peak = cache_64_mib_on_two_streams(sim);
  // Each lane alone stays within the distance to the peak; the two together pass it.
  Block* x1 = sim.alloc.malloc(40 * MiB, kStream1);
  Block* x2 = sim.alloc.malloc(40 * MiB, kStream2);
  const I held = static_cast<I>(x1->size + x2->size);
  REQUIRE(held > peak);
  const DeviceStats s = sim.stats();
  REQUIRE(s.allocated_bytes[kAll].current == held);
  REQUIRE(s.allocated_bytes[kAll].peak == held);
  REQUIRE(s.allocated_bytes[kLargePool].peak == held);
  REQUIRE(s.requested_bytes[kAll].peak == static_cast<I>(80 * MiB));
  sim.alloc.free(x1);
  sim.alloc.free(x2);
  sim.alloc.check_invariants();
}

namespace {

// The randomized workload of the comparison below, on four streams of one thread: random sizes
// from 512 B to 4 MiB, up to 24 held; `reset_each_step`: the peaks are reset before every call.
void compare_lanes_with_whole_device(bool growable, bool reset_each_step) {
  INFO((growable ? "growable segments" : "plain segments") << (reset_each_step ? ", peaks reset each step" : ""));
  const StreamId streams[] = {kStream0, kStream1, kStream2, kStream3};
  Sim lanes_sim(std::nullopt, kDeviceBytes, 0.0, growable ? kSimPage : 0);
  Sim whole_sim(std::nullopt, kDeviceBytes, 0.0, growable ? kSimPage : 0);
  // The same blocks in both: a 512-byte malloc and free on each test stream and on 32 others, in
  // an order that gives the test streams slots (lanes) in the first only.
  for (StreamId s : streams) lanes_sim.alloc.free(lanes_sim.alloc.malloc(512, s));
  for (int i = 0; i < DeviceLock::kSlots; ++i) {
    const auto other = static_cast<StreamId>(1000 + i);
    lanes_sim.alloc.free(lanes_sim.alloc.malloc(512, other));
    whole_sim.alloc.free(whole_sim.alloc.malloc(512, other));
  }
  for (StreamId s : streams) whole_sim.alloc.free(whole_sim.alloc.malloc(512, s));
  // A cache, and peaks, to run under: 48 blocks on each stream held at once, then freed.
  std::vector<std::pair<Block*, Block*>> warm;
  for (int i = 0; i < 48; ++i) {
    const std::size_t size = (std::size_t{1} << (9 + i % 14)) + 512 * static_cast<std::size_t>(i);
    const StreamId stream = streams[i % 4];
    warm.emplace_back(lanes_sim.alloc.malloc(size, stream), whole_sim.alloc.malloc(size, stream));
  }
  for (const auto& [a, b] : warm) {
    lanes_sim.alloc.free(a);
    whole_sim.alloc.free(b);
  }
  const std::uint64_t whole_on_device_before = whole_sim.alloc.work_counts().on_device;  // the other streams'
  std::uint64_t whole_calls = 0;

  std::mt19937_64 rng(growable ? 7 : 8);
  std::uniform_real_distribution<double> log_size(std::log(512.0), std::log(4.0 * MiB));
  std::vector<std::pair<Block*, Block*>> live;  // the same block in each
  // A call is cached if it needed no new memory (reserved did not move); those are the lanes' to serve.
  std::uint64_t cached_calls = 0, served_cached = 0;
  const auto call = [&](auto&& run) {
    const std::size_t reserved = lanes_sim.alloc.reserved();
    const std::uint64_t on_device = lanes_sim.alloc.work_counts().on_device;
    run();
    if (lanes_sim.alloc.reserved() == reserved) {
      ++cached_calls;
      served_cached += 1 - (lanes_sim.alloc.work_counts().on_device - on_device);
    }
  };
  for (int op = 0; op < 6000; ++op) {
    if (reset_each_step) {
      lanes_sim.alloc.reset_peak_stats();
      whole_sim.alloc.reset_peak_stats();
    }
    const int roll = static_cast<int>(rng() % 100);
    if (!live.empty() && (roll < 46 || live.size() > 24)) {
      const std::size_t i = rng() % live.size();
      call([&] { lanes_sim.alloc.free(live[i].first); });
      whole_sim.alloc.free(live[i].second);
      ++whole_calls;
      live[i] = live.back();
      live.pop_back();
    } else if (roll < 97) {
      const auto size = static_cast<std::size_t>(std::exp(log_size(rng)));
      const StreamId stream = streams[rng() % 4];
      Block* in_lanes = nullptr;
      call([&] { in_lanes = lanes_sim.alloc.malloc(size, stream); });
      Block* in_whole = whole_sim.alloc.malloc(size, stream);
      ++whole_calls;
      REQUIRE(in_lanes->size == in_whole->size);
      live.emplace_back(in_lanes, in_whole);
    } else if (roll < 98) {
      lanes_sim.alloc.reset_peak_stats();
      whole_sim.alloc.reset_peak_stats();
    } else if (roll < 99) {
      lanes_sim.alloc.reset_accumulated_stats();
      whole_sim.alloc.reset_accumulated_stats();
    }
    if (op % 97 == 0 || roll >= 99) {  // not after every operation: the lanes run on between reads
      INFO("after operation " << op);
      REQUIRE(flatten(lanes_sim.alloc.stats()) == flatten(whole_sim.alloc.stats()));
    }
  }
  REQUIRE(flatten(lanes_sim.alloc.stats()) == flatten(whole_sim.alloc.stats()));
  // The lanes served the cached calls, and a peak reset does not send them to the whole device.
  INFO("served in lanes: " << served_cached << " of " << cached_calls << " cached calls");
  REQUIRE(cached_calls > 4000);
  REQUIRE(served_cached * 100 >= cached_calls * 95);
  // The test streams have no lane there: every call took the whole device.
  REQUIRE(whole_sim.alloc.work_counts().on_device - whole_on_device_before == whole_calls);
  lanes_sim.alloc.check_invariants();
  for (const auto& [a, b] : live) {
    lanes_sim.alloc.free(a);
    whole_sim.alloc.free(b);
  }
  REQUIRE(flatten(lanes_sim.alloc.stats()) == flatten(whole_sim.alloc.stats()));
}

}  // namespace

TEST_CASE("the cached path in lanes keeps every statistic, of every pool, as the whole device keeps it",
          "[lanes][stats]") {
  for (const bool growable : {false, true}) compare_lanes_with_whole_device(growable, false);
}

TEST_CASE("the lanes serve the cached calls, and keep every statistic exact, with the peaks reset before each call",
          "[lanes][stats]") {
  for (const bool growable : {false, true}) compare_lanes_with_whole_device(growable, true);
}

TEST_CASE("random cached mallocs and frees on four streams keep every current and peak exact",
          "[lanes][stats]") {
  Sim sim;
  std::mt19937_64 rng(15);
  std::uniform_real_distribution<double> log_size(std::log(512.0), std::log(48.0 * MiB));
  const StreamId streams[] = {kStream0, kStream1, kStream2, kStream3};
  Model model;
  std::vector<Live> live;
  for (int op = 0; op < 20000; ++op) {
    const int roll = static_cast<int>(rng() % 100);
    if (!live.empty() && (roll < 45 || live.size() > 48)) {
      const std::size_t i = rng() % live.size();
      model.free(live[i].block, live[i].requested);
      sim.alloc.free(live[i].block);
      live[i] = live.back();
      live.pop_back();
    } else if (roll < 97) {
      const auto size = static_cast<std::size_t>(std::exp(log_size(rng)));
      Block* block = sim.alloc.malloc(size, streams[rng() % 4]);
      model.hand_out(block, size);
      live.push_back({block, size});
    } else if (roll < 98) {
      sim.alloc.reset_peak_stats();
      model.reset_peak();
    } else {
      INFO("after operation " << op);
      require_matches(sim.alloc.stats(), model);
    }
  }
  require_matches(sim.alloc.stats(), model);
  sim.alloc.check_invariants();  // inactive split blocks and the rest, recounted from the blocks
  for (const Live& l : live) sim.alloc.free(l.block);
  sim.alloc.check_invariants();
}

TEST_CASE("streams past the lanes' slots are served under the whole device, with exact statistics", "[lanes][stats]") {
  Sim sim;
  constexpr int kStreams = DeviceLock::kSlots + 8;
  Model model;
  std::vector<Live> live;
  for (int round = 0; round < 3; ++round) {
    for (int s = 0; s < kStreams; ++s) {
      const std::size_t size = (static_cast<std::size_t>(s) + 1) * 3 * KiB;
      Block* block = sim.alloc.malloc(size, static_cast<StreamId>(100 + s));
      REQUIRE(block->stream == static_cast<StreamId>(100 + s));
      model.hand_out(block, size);
      live.push_back({block, size});
    }
    for (std::size_t i = 0; i < live.size(); i += 2) {
      model.free(live[i].block, live[i].requested);
      sim.alloc.free(live[i].block);
    }
    std::vector<Live> kept;
    for (std::size_t i = 1; i < live.size(); i += 2) kept.push_back(live[i]);
    live = kept;
    require_matches(sim.alloc.stats(), model);
    sim.alloc.check_invariants();
  }
}

TEST_CASE("threads on their own streams end with the statistics of what they still hold", "[lanes][threads]") {
  Sim sim;
  constexpr int kThreads = 4;
  constexpr int kOps = 20000;
  std::vector<std::vector<Live>> kept(kThreads);
  std::vector<I> own_peak(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
      std::vector<Live> live;
      I held = 0;
      for (int op = 0; op < kOps; ++op) {
        if (!live.empty() && (rng() % 2 == 0 || live.size() > 16)) {
          const std::size_t i = rng() % live.size();
          held -= static_cast<I>(live[i].block->size);
          sim.alloc.free(live[i].block);
          live[i] = live.back();
          live.pop_back();
        } else {
          const std::size_t size = 512 + rng() % (4 * MiB);
          Block* block = sim.alloc.malloc(size, static_cast<StreamId>(10 + t));
          held += static_cast<I>(block->size);
          own_peak[t] = std::max(own_peak[t], held);
          live.push_back({block, size});
        }
      }
      kept[t] = live;
    });
  }
  for (std::thread& th : threads) th.join();
  I bytes = 0, requested = 0, count = 0, sum_of_peaks = 0;
  for (int t = 0; t < kThreads; ++t) {
    for (const Live& l : kept[t]) {
      bytes += static_cast<I>(l.block->size);
      requested += static_cast<I>(l.requested);
      ++count;
    }
    sum_of_peaks += own_peak[t];
  }
  const DeviceStats s = sim.alloc.stats();
  REQUIRE(s.allocation[kAll].current == count);
  REQUIRE(s.allocated_bytes[kAll].current == bytes);
  REQUIRE(s.requested_bytes[kAll].current == requested);
  REQUIRE(s.allocation[kAll].allocated == s.allocation[kAll].freed + count);
  // The peak is the whole's: at least any one thread's, never more than all of theirs at once.
  for (int t = 0; t < kThreads; ++t) REQUIRE(s.allocated_bytes[kAll].peak >= own_peak[t]);
  REQUIRE(s.allocated_bytes[kAll].peak <= sum_of_peaks);
  sim.alloc.check_invariants();
  for (const auto& live : kept) {
    for (const Live& l : live) sim.alloc.free(l.block);
  }
  sim.alloc.check_invariants();
}

namespace {

// How much `run` moves the count `read` gives.
template <class Read, class Run>
auto growth_by(Read read, Run run) {
  const auto before = read();
  run();
  return read() - before;
}

// How many of the `calls` calls `run` makes the lanes served (the others took the whole device).
template <class Run>
std::uint64_t served_in_lanes_by(Sim& sim, Run run, std::uint64_t calls = 2) {
  return calls - growth_by([&] { return sim.alloc.work_counts().on_device; }, run);
}

// A cached malloc and free of 4 MiB on stream 1: both served in its lane while it is open.
void cached_pair(Sim& sim) { sim.alloc.free(sim.alloc.malloc(4 * MiB, kStream1)); }

}  // namespace

TEST_CASE("the lanes close while the whole device must see a call: a release threshold, a pending block, the limit passed, a capture",
          "[lanes]") {
  Sim sim;
  // A cache and peaks to run under: a 20 MiB segment split into a held 2 MiB block and, after an
  // 8 MiB block came and went, 18 MiB free. A 4 MiB pair cut from it then fits every lane's room.
  Block* kept = sim.alloc.malloc(2 * MiB, kStream1);
  sim.alloc.free(sim.alloc.malloc(8 * MiB, kStream1));
  REQUIRE(served_in_lanes_by(sim, [&] { cached_pair(sim); }) == 2);

  SECTION("a release threshold: frees go to the whole device, which applies it") {
    sim.alloc.set_release_threshold(0.9);
    REQUIRE(served_in_lanes_by(sim, [&] { cached_pair(sim); }) == 1);  // the malloc only
    sim.alloc.set_release_threshold(0.0);
    REQUIRE(served_in_lanes_by(sim, [&] { cached_pair(sim); }) == 2);
  }
  SECTION("a block pending on another stream: mallocs go to the whole device, which looks at its events") {
    Block* shared = sim.alloc.malloc(MiB, kStream1);
    sim.alloc.record_stream(shared, kStream2);
    sim.alloc.free(shared);
    REQUIRE(served_in_lanes_by(sim, [&] { cached_pair(sim); }) == 1);  // the free only: the event is not done
    REQUIRE(sim.stats().active[kAll].current == 2);  // the kept block, and the shared one
    sim.backend.complete_events();
    // The next malloc still goes to the whole device, which finds the event done and opens the lanes.
    REQUIRE(served_in_lanes_by(sim, [&] { cached_pair(sim); }) == 1);
    REQUIRE(sim.stats().active[kAll].current == 1);
    REQUIRE(served_in_lanes_by(sim, [&] { cached_pair(sim); }) == 2);
  }
  SECTION("reserved above a lowered limit: the free goes to the whole device, which gives the memory back") {
    Block* held = sim.alloc.malloc(8 * MiB, kStream1);
    sim.alloc.set_limit(std::size_t{4} * MiB);  // the segment of the held blocks stays: reserved is above it
    REQUIRE(sim.alloc.reserved() > sim.alloc.limit());
    REQUIRE(served_in_lanes_by(sim, [&] {
              sim.alloc.free(held);
              sim.alloc.free(kept);
            }) == 0);
    kept = nullptr;
    REQUIRE(sim.alloc.reserved() <= sim.alloc.limit());
    REQUIRE(sim.ledger().in_use == sim.alloc.reserved());
  }
  SECTION("a pool target (a graph may be capturing): neither goes to a lane, and the block is the pool's") {
    const PoolId pool{1, 1};
    sim.alloc.create_pool(pool);
    sim.alloc.begin_allocate_to_pool(pool, [](StreamId s) { return s == kStream1; });
    REQUIRE(served_in_lanes_by(sim, [&] {
              Block* in_pool = sim.alloc.malloc(4 * MiB, kStream1);
              REQUIRE(sim.segment_of(in_pool).pool == pool);
              sim.alloc.free(in_pool);
            }) == 0);
    sim.alloc.end_allocate_to_pool(pool);
    sim.alloc.release_pool(pool);
    REQUIRE(served_in_lanes_by(sim, [&] { cached_pair(sim); }) == 2);
  }
  if (kept) sim.alloc.free(kept);
  sim.alloc.check_invariants();
}

TEST_CASE("a block that is its whole segment is freed in its lane, with no inactive split blocks ever counted", "[lanes]") {
  Sim sim;
  Block* whole = sim.alloc.malloc(12 * MiB, kStream1);  // 10 MiB and more: a segment of its own
  REQUIRE(sim.snapshot().size() == 1);
  REQUIRE(sim.snapshot()[0].blocks.size() == 1);
  sim.alloc.free(whole);  // the whole device's: the stream had no free blocks of the pool before
  // The inactive split figures are at their peak (0), so a free that could add one would not fit.
  REQUIRE(served_in_lanes_by(sim, [&] { sim.alloc.free(sim.alloc.malloc(12 * MiB, kStream1)); }) == 2);
  const DeviceStats s = sim.stats();
  REQUIRE(s.inactive_split[kAll].peak == 0);
  REQUIRE(s.inactive_split_bytes[kAll].peak == 0);
  REQUIRE(s.allocated_bytes[kAll].peak == static_cast<I>(12 * MiB));
  sim.alloc.check_invariants();
}

namespace {

// Host memory of the block lists: what `run` made the arenas add.
template <class Run>
std::size_t blocks_made_by(Sim& sim, Run run) {
  return growth_by([&] { return sim.alloc.work_counts().blocks_made; }, run);
}

}  // namespace

TEST_CASE("a malloc and free loop on one stream makes no Blocks, whichever path each call takes", "[lanes]") {
  for (const bool growable : {false, true}) {
    INFO((growable ? "growable segments" : "plain segments"));
    Sim sim(std::nullopt, kDeviceBytes, 0.0, growable ? kSimPage : 0);
    const auto pairs = [&](int n) {
      for (int i = 0; i < n; ++i) sim.alloc.free(sim.alloc.malloc(4096, kStream1));
    };
    pairs(1000);
    SECTION("both calls in the lane") {
      REQUIRE(blocks_made_by(sim, [&] { pairs(200000); }) == 0);
    }
    SECTION("the malloc in the lane, the free under the whole device (a release threshold closes frees)") {
      sim.alloc.set_release_threshold(1.0);
      REQUIRE(blocks_made_by(sim, [&] { pairs(200000); }) == 0);
    }
    SECTION("the malloc under the whole device (a block pends on another stream), the free in the lane") {
      Block* pending = sim.alloc.malloc(4096, kStream2);
      sim.alloc.record_stream(pending, kStream3);
      sim.alloc.free(pending);  // its event is not done: mallocs go to the whole device
      REQUIRE(blocks_made_by(sim, [&] { pairs(200000); }) == 0);
    }
    sim.alloc.check_invariants();  // every arena's Blocks are its spares and its streams' blocks
  }
}

TEST_CASE("training-like steps with a peak reset each step make no Blocks after the first", "[lanes]") {
  for (const bool growable : {false, true}) {
    INFO((growable ? "growable segments" : "plain segments"));
    Sim sim(std::nullopt, kDeviceBytes, 0.0, growable ? kSimPage : 0);
    std::mt19937_64 rng(3);
    std::vector<std::size_t> sizes(64);
    for (std::size_t& size : sizes) size = 512 + rng() % (8 * MiB);
    const auto step = [&] {
      sim.alloc.reset_peak_stats();
      std::vector<Block*> held;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        held.push_back(sim.alloc.malloc(sizes[i], i % 3 == 0 ? kStream2 : kStream1));
        if (i % 4 == 3) {  // a quarter are freed within the step, in another order than made
          sim.alloc.free(held[held.size() - 2]);
          held.erase(held.end() - 2);
        }
      }
      for (Block* b : held) sim.alloc.free(b);
    };
    for (int i = 0; i < 3; ++i) step();
    REQUIRE(blocks_made_by(sim, [&] {
              for (int i = 0; i < 5000; ++i) step();
            }) == 0);
    sim.alloc.check_invariants();
  }
}

// The lanes' ledgers on their own (core/lane_ledgers.h): a lane that finds another lane's changes
// not yet taken in takes them in when that lane is idle, so the peak stays exact; when that lane
// is busy, the peak taken in is the highest the two together could have reached.
TEST_CASE("a lane takes in an idle lane's changes first; with a busy one the peak is the highest both could reach",
          "[lanes][stats]") {
  DeviceLock lanes;
  LaneLedgers ledgers;
  StatLedger device;
  Lane& a = lanes.lane(0);
  Lane& b = lanes.lane(1);
  // Lane a hands out 100 KiB and takes it back; lane b then hands out 60 KiB and holds it.
  auto rise_and_fall_in_a = [&] {
    LaneGuard guard(a);
    StatLedger& stats = ledgers.enter(lanes, a, device);
    stats.hand_out(false, 100 * KiB, 100 * KiB);
    stats.release(false, 100 * KiB);
    stats.settle(false, 100 * KiB);
  };
  auto hold_in_b = [&] {
    LaneGuard guard(b);
    ledgers.enter(lanes, b, device).hand_out(false, 60 * KiB, 60 * KiB);
  };
  auto take_in = [&] {
    lanes.lock();
    ledgers.take_in(lanes, device);
    lanes.unlock({true, true});
    return device.snapshot();
  };
  SECTION("lane a idle when b starts: exact") {
    rise_and_fall_in_a();
    hold_in_b();
    const DeviceStats s = take_in();
    REQUIRE(s.allocated_bytes[kAll].current == static_cast<I>(60 * KiB));
    REQUIRE(s.allocated_bytes[kAll].peak == static_cast<I>(100 * KiB));
    REQUIRE(s.allocated_bytes[kLargePool].peak == static_cast<I>(100 * KiB));
    REQUIRE(s.allocation[kAll].peak == 1);
    REQUIRE(s.allocated_bytes[kAll].allocated == static_cast<I>(160 * KiB));
    REQUIRE(s.allocated_bytes[kAll].freed == static_cast<I>(100 * KiB));
  }
  SECTION("lane a busy when b starts: the peak is both lanes' highest rises together") {
    rise_and_fall_in_a();
    a.lock.lock();  // a thread is in lane a now
    hold_in_b();
    a.lock.unlock();
    DeviceStats s = take_in();
    REQUIRE(s.allocated_bytes[kAll].current == static_cast<I>(60 * KiB));
    REQUIRE(s.allocated_bytes[kAll].peak == static_cast<I>(160 * KiB));
    REQUIRE(s.allocation[kAll].peak == 2);
    REQUIRE(s.allocated_bytes[kAll].allocated == static_cast<I>(160 * KiB));
    // After the whole device ran, the lanes are exact again: a rises by 100 KiB over b's 60 KiB.
    device.reset_peak();
    rise_and_fall_in_a();
    s = take_in();
    REQUIRE(s.allocated_bytes[kAll].peak == static_cast<I>(160 * KiB));
    device.reset_peak();
    hold_in_b();
    rise_and_fall_in_a();
    s = take_in();
    REQUIRE(s.allocated_bytes[kAll].current == static_cast<I>(120 * KiB));
    REQUIRE(s.allocated_bytes[kAll].peak == static_cast<I>(220 * KiB));
  }
}

TEST_CASE("a block split off the front of a free block heads a split; the one cut after it does not", "[lanes]") {
  Sim sim;
  Block* first = sim.alloc.malloc(64 * KiB, kStream1);  // a new small segment, cut: the rest follows
  REQUIRE(sim.alloc.heads_a_split(first));
  Block* second = sim.alloc.malloc(64 * KiB, kStream1);  // cut from the rest, behind `first`
  REQUIRE_FALSE(sim.alloc.heads_a_split(second));
  sim.alloc.free(first);
  sim.alloc.free(second);
}

TEST_CASE("whether a block heads a split is read right while another stream allocates and frees in its lane", "[lanes][threads]") {
  Sim sim;
  Block* mine = sim.alloc.malloc(64 * KiB, kStream2);
  // The other stream starts only once this thread is asking, and this thread asks until it ends,
  // so the two overlap however the threads are scheduled (a loaded machine could otherwise run
  // the whole loop before the first question).
  std::atomic<bool> asking{false};
  std::atomic<bool> done{false};
  std::thread other([&] {
    while (!asking) std::this_thread::yield();
    for (int i = 0; i < 20000; ++i) sim.alloc.free(sim.alloc.malloc(128 * KiB, kStream1));
    done = true;
  });
  do {
    REQUIRE(sim.alloc.heads_a_split(mine));
    asking = true;
  } while (!done);
  other.join();
  sim.alloc.free(mine);
}
