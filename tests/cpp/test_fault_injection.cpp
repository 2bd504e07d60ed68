// A device that refuses or breaks: the simulated backend's fault injection (fail_next, fail_randomly,
// fail_when) under random operations. A request either succeeds or throws an OutOfMemoryError whose
// kind names the real cause; nothing leaks; the statistics stay true after every operation.
#include <catch2/catch.hpp>

#include "env_settings.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/sim_backend.h"
#include "core/caching_allocator.h"
#include "core/device_allocator.h"
#include "core/sizing.h"

namespace {

using gpumem::Block;
using gpumem::DeviceAllocator;
using gpumem::OomInfo;
using gpumem::OomKind;
using gpumem::OutOfMemoryError;
using gpumem::SimBackend;
using gpumem::StreamId;

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t kCapacity = 8 * GiB;
constexpr std::size_t kMaxLive = 64;
constexpr StreamId kStreams = 3;

using gpumem_test::env_number;

// The random runs follow the property tests' settings: GPUMEM_PROPERTY_OPS scales them down,
// GPUMEM_PROPERTY_SEED replaces their seeds.
std::size_t ops_per_run() { return std::max<std::uint64_t>(env_number("GPUMEM_PROPERTY_OPS", 1000000) / 20, 20000); }

std::uint64_t seed(std::uint64_t offset) { return env_number("GPUMEM_PROPERTY_SEED", 7000) + offset; }

struct Violation : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void expect(bool ok, const std::string& what) {
  if (!ok) throw Violation(what);
}

// The error thrown by a backend whose driver broke, as opposed to one that is merely full.
struct DriverError : std::runtime_error {
  DriverError() : std::runtime_error("simulated driver failure") {}
};

struct Tally {
  std::size_t ooms[3] = {0, 0, 0};   // by OomKind
  std::size_t served_after_refusal = 0;
  std::size_t driver_errors = 0;

  std::size_t total_ooms() const { return ooms[0] + ooms[1] + ooms[2]; }
};

// Random malloc (log-uniform 512 B..64 MiB), free, record_stream, complete_events, empty_cache
// and set_limit on one device whose backend may refuse or throw; checked after every operation.
class FaultRun {
 public:
  FaultRun(std::optional<std::size_t> limit, std::uint64_t seed)
      : backend(kCapacity), alloc(backend, 0, {limit, 0.0}), seed_(seed), base_limit_(limit), rng_(seed) {}

  void run(std::size_t ops) {
    try {
      for (op_ = 0; op_ < ops; ++op_) step();
      finish();
    } catch (const std::exception& e) {
      FAIL("seed " << seed_ << ", operation #" << op_ << " (" << op_name_ << "): " << e.what());
    }
  }

  // Called with each OOM after the general checks, for what a test knows about its faults.
  std::function<void(const OomInfo&, std::size_t rounded)> on_oom;
  // When nonzero, one operation in this many is preceded by fail_next(1..3).
  std::size_t burst_every = 0;

  SimBackend backend;
  DeviceAllocator alloc;
  Tally tally;

 private:
  std::size_t draw(std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_); }

  std::size_t draw_size() {
    std::uniform_real_distribution<double> u(std::log(512.0), std::log(64.0 * MiB));
    return static_cast<std::size_t>(std::exp(u(rng_)));
  }

  void step() {
    if (burst_every && draw(burst_every) == 0) backend.fail_next(1 + static_cast<int>(draw(3)));
    const std::size_t roll = draw(100);
    if (live_.size() >= kMaxLive || (roll < 36 && !live_.empty())) {
      do_free();
    } else if (roll < 86) {
      do_malloc();
    } else if (roll < 93) {
      op_name_ = "record_stream";
      if (!live_.empty()) alloc.record_stream(live_[draw(live_.size())], draw(kStreams));
    } else if (roll < 97) {
      op_name_ = "complete_events";
      backend.complete_events();
    } else if (roll < 99) {
      op_name_ = "empty_cache";
      alloc.empty_cache();
    } else {
      do_set_limit();
    }
    check_after_op();
  }

  void do_malloc() {
    op_name_ = "malloc";
    const std::size_t requested = draw_size();
    const std::size_t limit = alloc.limit();
    const std::uint64_t refusals = backend.ledger(0).refusals;
    try {
      Block* block = alloc.malloc(requested, draw(kStreams));
      live_.push_back(block);
      allocated_ += block->size;
      if (backend.ledger(0).refusals > refusals) ++tally.served_after_refusal;
    } catch (const OutOfMemoryError& e) {
      check_oom(e.info(), requested, limit, backend.ledger(0).refusals > refusals);
    } catch (const DriverError&) {
      ++tally.driver_errors;
    }
  }

  void check_oom(const OomInfo& info, std::size_t requested, std::size_t limit, bool refused) {
    ++tally.ooms[static_cast<int>(info.kind)];
    const std::size_t rounded = gpumem::round_size(requested);
    const std::size_t tight = gpumem::tight_segment_size(rounded);
    expect(info.requested == requested && info.allocated == allocated_ && info.limit == limit,
           "OOM reports other figures than the request, the live blocks and the limit");
    switch (info.kind) {
      case OomKind::kDeviceFull:
        expect(refused, "OOM says device full but the device refused nothing");
        expect(alloc.reserved() + tight <= limit, "OOM says device full but the limit would refuse the segment too");
        break;
      case OomKind::kOverLimit:
        expect(!refused, "the device refused, yet the OOM blames the limit");
        expect(allocated_ + rounded > limit, "OOM over the limit although allocated + request fit under it");
        break;
      case OomKind::kFragmentation:
        expect(!refused, "the device refused, yet the OOM blames fragmentation");
        expect(allocated_ + rounded <= limit && alloc.reserved() + tight > limit,
               "OOM called fragmentation although the request or its segment fit");
        break;
    }
    if (on_oom) on_oom(info, rounded);
  }

  void do_free() {
    op_name_ = "free";
    const std::size_t i = draw(live_.size());
    allocated_ -= live_[i]->size;
    alloc.free(live_[i]);
    live_[i] = live_.back();
    live_.pop_back();
  }

  void do_set_limit() {
    op_name_ = "set_limit";
    if (!base_limit_) return;
    static constexpr double kFactors[] = {0.5, 1.0, 1.5};
    alloc.set_limit(static_cast<std::size_t>(static_cast<double>(*base_limit_) * kFactors[draw(3)]));
  }

  void check_after_op() {
    alloc.check_invariants();
    const SimBackend::Ledger ledger = backend.ledger(0);
    expect(ledger.in_use == alloc.reserved(), "the device ledger and reserved() disagree");
    const gpumem::DeviceStats stats = alloc.stats();
    expect(stats.num_ooms == static_cast<std::int64_t>(tally.total_ooms()), "num_ooms differs from the OOMs seen");
    expect(stats.allocated_bytes[gpumem::kAll].current == static_cast<std::int64_t>(allocated_),
           "allocated bytes differ from the live blocks");
    expect(stats.num_device_alloc == static_cast<std::int64_t>(ledger.reserves) &&
               stats.num_device_free == static_cast<std::int64_t>(ledger.releases),
           "segment counts differ from the device's successful reserve and release calls");
  }

  void finish() {
    op_name_ = "stop failing, free everything, complete_events, empty_cache";
    backend.stop_failing();
    for (Block* block : live_) alloc.free(block);
    live_.clear();
    allocated_ = 0;
    backend.complete_events();
    alloc.empty_cache();
    alloc.check_invariants();
    const SimBackend::Ledger ledger = backend.ledger(0);
    expect(alloc.reserved() == 0, "memory still reserved after freeing everything and empty_cache");
    expect(ledger.in_use == 0, "the device still has memory handed out");
    expect(ledger.live_events == 0, "events were leaked");
    expect(alloc.stats().active_bytes[gpumem::kAll].current == 0, "blocks still active");
  }

  const std::uint64_t seed_;
  const std::optional<std::size_t> base_limit_;
  std::mt19937_64 rng_;
  std::vector<Block*> live_;
  std::size_t allocated_ = 0;
  std::size_t op_ = 0;
  const char* op_name_ = "";
};

}  // namespace

// ---- refusals at random --------------------------------------------------------------------------

TEST_CASE("random device refusals end in a retry or a device-full OOM, and leak nothing", "[fault]") {
  const double probability = GENERATE(0.1, 0.4);
  const std::optional<std::size_t> limit = GENERATE(std::optional<std::size_t>(256 * MiB), std::optional<std::size_t>());
  CAPTURE(probability, limit.value_or(0));
  FaultRun run(limit, seed(1));
  run.backend.fail_randomly(probability, static_cast<std::uint32_t>(seed(2)));
  run.run(ops_per_run());
  CHECK(run.backend.ledger(0).refusals > 0);
  CHECK(run.tally.served_after_refusal > 0);  // the fallback chain absorbed some refusals
}

// ---- refusals on command -------------------------------------------------------------------------

TEST_CASE("one device refusal is absorbed by the retry", "[fault]") {
  SimBackend backend(kCapacity);
  DeviceAllocator alloc(backend, 0, {});
  backend.fail_next(1);
  Block* block = alloc.malloc(1 * MiB, 0);
  REQUIRE(backend.ledger(0).refusals == 1);
  REQUIRE(alloc.stats().num_alloc_retries == 1);
  REQUIRE(alloc.stats().num_ooms == 0);
  alloc.free(block);
  alloc.empty_cache();
  REQUIRE(backend.ledger(0).in_use == 0);
}

TEST_CASE("bursts of refusals amid random operations end in a retry or a device-full OOM, and leak nothing",
          "[fault]") {
  const std::optional<std::size_t> limit = GENERATE(std::optional<std::size_t>(256 * MiB), std::optional<std::size_t>());
  CAPTURE(limit.value_or(0));
  FaultRun run(limit, seed(51));
  run.burst_every = 20;
  run.run(ops_per_run());
  CHECK(run.tally.ooms[static_cast<int>(OomKind::kDeviceFull)] > 0);
  CHECK(run.tally.served_after_refusal > 0);
}

// ---- refusals by rule ----------------------------------------------------------------------------

TEST_CASE("a device that refuses segments above a size fails exactly the requests that need one", "[fault]") {
  constexpr std::size_t kLargestSegment = 32 * MiB;
  FaultRun run(std::nullopt, seed(101));
  run.backend.fail_when([](int, std::size_t bytes) { return bytes > kLargestSegment; });
  std::size_t device_full = 0;
  run.on_oom = [&](const OomInfo& info, std::size_t rounded) {
    const bool needs_big_segment = gpumem::tight_segment_size(rounded) > kLargestSegment;
    if (needs_big_segment != (info.kind == OomKind::kDeviceFull)) {
      throw Violation("a request of " + std::to_string(info.requested) + " bytes failed as " +
                      gpumem::oom_kind_name(info.kind));
    }
    device_full += info.kind == OomKind::kDeviceFull;
  };
  run.run(ops_per_run());
  CHECK(device_full > 0);
}

TEST_CASE("a device that refuses everything leaves the other devices serving", "[fault]") {
  SimBackend backend(kCapacity, 2);
  gpumem::CachingAllocator alloc(backend);
  backend.fail_when([](int device, std::size_t) { return device == 1; });
  Block* on_0 = alloc.malloc(0, 3 * MiB, 0);
  try {
    alloc.malloc(1, 3 * MiB, 0);
    FAIL("device 1 served although it refuses everything");
  } catch (const OutOfMemoryError& e) {
    REQUIRE(e.info().kind == OomKind::kDeviceFull);
    REQUIRE(e.info().device == 1);
  }
  REQUIRE(alloc.device(0).stats().num_ooms == 0);
  REQUIRE(alloc.device(1).stats().num_ooms == 1);
  REQUIRE(backend.ledger(1).in_use == 0);
  gpumem::CachingAllocator::free(on_0);
}

// ---- a backend that throws -----------------------------------------------------------------------

TEST_CASE("a backend that throws mid-request passes the error on and leaves the allocator consistent", "[fault]") {
  FaultRun run(512 * MiB, seed(201));
  std::mt19937 faults(static_cast<std::uint32_t>(seed(202)));
  run.backend.fail_when([&faults](int, std::size_t) -> bool {
    if (std::uniform_int_distribution<int>(0, 19)(faults) == 0) throw DriverError();
    return false;
  });
  run.run(ops_per_run());
  CHECK(run.tally.driver_errors > 0);
}
