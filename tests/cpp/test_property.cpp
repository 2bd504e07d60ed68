// Seeded random operations on one DeviceAllocator over the simulated device. After every operation
// the allocator is held against its own invariant checker and against two accounts it does not
// keep: the simulated device's ledger (what was really reserved) and this test's map of live blocks.
//
// GPUMEM_PROPERTY_OPS sets the total number of operations across all configurations (default
// 1,000,000; sanitizer builds use fewer). GPUMEM_PROPERTY_SEED replaces the base seed; a failure
// prints the seed, the configuration and the operation that broke a property.
#include <catch2/catch.hpp>

#include "env_settings.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/sim_backend.h"
#include "core/device_allocator.h"
#include "core/sizing.h"

namespace {

using gpumem::Block;
using gpumem::BlockInfo;
using gpumem::DeviceAllocator;
using gpumem::OomKind;
using gpumem::OutOfMemoryError;
using gpumem::SegmentInfo;
using gpumem::SimBackend;
using gpumem::StreamId;

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t kCapacity = 8 * GiB;
constexpr std::size_t kMaxLive = 192;  // the checker walks every block; more would only slow it
constexpr std::size_t kPhaseOps = 4096;
constexpr std::size_t kBestFitSample = 8;
constexpr std::size_t kMallocShares[] = {3000, 3950, 3950, 4800};  // per 10,000 operations
constexpr StreamId kStreams = 3;
constexpr int kConfigsPerMix = 3;
constexpr int kMixes = 6;  // three size mixes, each over plain and over growable segments

using gpumem_test::env_number;

std::size_t ops_per_config() {
  const std::uint64_t total = env_number("GPUMEM_PROPERTY_OPS", 1000000);
  return static_cast<std::size_t>(std::max<std::uint64_t>(total / (kMixes * kConfigsPerMix), 100));
}

// Request sizes drawn log-uniformly from [lo, hi].
struct SizeMix {
  const char* name;
  std::size_t lo;
  std::size_t hi;
  std::size_t tight;   // limits for the three configurations; the third is "none"
  std::size_t medium;
};

constexpr SizeMix kSmallOnly{"small only (1 B..1 MiB)", 1, gpumem::kSmallSize, 8 * MiB, 64 * MiB};
constexpr SizeMix kMixed{"mixed (512 B..64 MiB)", 512, 64 * MiB, 128 * MiB, 1 * GiB};
constexpr SizeMix kLargeOnly{"large only (1 MiB..64 MiB)", gpumem::kSmallSize + 1, 64 * MiB, 256 * MiB, 2 * GiB};

struct Config {
  SizeMix mix;
  const char* limit_name;
  std::optional<std::size_t> limit;  // nullopt: no limit (the device's total)
  std::uint64_t seed;
  std::size_t page;                  // 0: plain segments; else growable ones with pages of this size
};

constexpr std::size_t kPage = 2 * MiB;

SimBackend& with_pages(SimBackend& backend, std::size_t page) {
  if (page > 0) backend.enable_virtual_memory(page);
  return backend;
}

struct Violation : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void expect(bool ok, const std::string& what) {
  if (!ok) throw Violation(what);
}

// A live block as the test knows it, independently of the allocator.
struct Live {
  Block* block;
  std::size_t requested;
};

bool is_unused(const SegmentInfo& s) { return s.blocks.size() == 1 && s.blocks[0].state == BlockInfo::kFree; }

bool any_pending(const std::vector<SegmentInfo>& segments) {
  for (const SegmentInfo& s : segments) {
    for (const BlockInfo& b : s.blocks) {
      if (b.state == BlockInfo::kPendingFree) return true;
    }
  }
  return false;
}

// What the blocks freed by their callers but still used by a stream asked for: requested_bytes
// keeps it until they are free, as native does.
std::size_t pending_requests(const std::vector<SegmentInfo>& segments) {
  std::size_t bytes = 0;
  for (const SegmentInfo& s : segments) {
    for (const BlockInfo& b : s.blocks) {
      if (b.state == BlockInfo::kPendingFree) bytes += b.requested;
    }
  }
  return bytes;
}

// The cached block best fit must pick for a block of `rounded` bytes on `stream`: the smallest
// free one of the size class that holds it, the lowest address among equals.
struct CachedFit {
  std::size_t size;
  std::uintptr_t addr;
};
std::optional<CachedFit> best_cached(const std::vector<SegmentInfo>& segments, std::size_t rounded, StreamId stream) {
  std::optional<CachedFit> best;
  for (const SegmentInfo& s : segments) {
    if (s.stream != stream || s.small != gpumem::is_small(rounded)) continue;
    for (const BlockInfo& b : s.blocks) {
      if (b.state != BlockInfo::kFree || b.size < rounded) continue;
      if (!best || b.size < best->size || (b.size == best->size && b.addr < best->addr)) best = CachedFit{b.size, b.addr};
    }
  }
  return best;
}

class PropertyRun {
 public:
  explicit PropertyRun(const Config& config)
      : config_(config),
        backend_(kCapacity),
        alloc_(with_pages(backend_, config.page), 0, {config.limit, 0.0}),
        rng_(config.seed),
        max_limit_(alloc_.limit()) {}

  void run(std::size_t ops) {
    for (std::size_t i = 0; i < ops; ++i) {
      op_index_ = i;
      step();
    }
    finish();
  }

  std::string where() const {
    std::ostringstream out;
    out << "operation #" << op_index_ << " (" << op_name_ << ")";
    return out.str();
  }

  const DeviceAllocator& allocator() const { return alloc_; }
  SimBackend::Ledger ledger() const { return backend_.ledger(0); }

 private:
  // ---- drawing ----

  std::size_t draw(std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_); }

  std::size_t draw_size() {
    std::uniform_real_distribution<double> u(std::log(static_cast<double>(config_.mix.lo)),
                                             std::log(static_cast<double>(config_.mix.hi)));
    const auto size = static_cast<std::size_t>(std::exp(u(rng_)));
    return std::clamp(size, config_.mix.lo, config_.mix.hi);
  }

  std::optional<std::size_t> draw_limit() {
    static constexpr double kFactors[] = {0.25, 0.5, 1.0, 1.0, 1.5, 2.0};
    const std::size_t base = config_.limit.value_or(kCapacity);
    const double factor = kFactors[draw(std::size(kFactors))];
    if (!config_.limit && factor == 1.0) return std::nullopt;
    return std::min(kCapacity, static_cast<std::size_t>(static_cast<double>(base) * factor));
  }

  // ---- one operation ----

  // Operations per 10,000. Phases of growth and shrinkage (the malloc share changes every
  // kPhaseOps) give the cache full, empty and fragmented states in turn.
  void step() {
    if (op_index_ % kPhaseOps == 0) malloc_share_ = kMallocShares[draw(std::size(kMallocShares))];
    reserved_before_ = alloc_.reserved();
    const std::size_t roll = draw(10000);
    if (live_.size() >= kMaxLive) {
      do_free();
    } else if (roll < 7900) {
      roll < malloc_share_ || live_.empty() ? do_malloc() : do_free();
    } else if (roll < 8900) {
      do_record_stream();
    } else if (roll < 9400) {
      op_name_ = "complete_events";
      backend_.complete_events();
    } else if (roll < 9500) {
      do_empty_cache();
    } else if (roll < 9800) {
      do_set_limit();
    } else if (roll < 9997) {
      do_set_release_threshold();
    } else {
      do_free_all();
    }
    check_after_op();
  }

  // One malloc in kBestFitSample is also checked for best fit, which needs a snapshot before it.
  void do_malloc() {
    op_name_ = "malloc";
    const std::size_t requested = draw_size();
    const StreamId stream = draw(kStreams);
    const std::size_t limit = alloc_.limit();
    const SimBackend::Ledger before = backend_.ledger(0);
    const bool sampled = draw(kBestFitSample) == 0;
    std::optional<CachedFit> expected;
    bool events_pending = false;
    if (sampled) {
      const std::vector<SegmentInfo> segments = alloc_.snapshot();
      expected = best_cached(segments, gpumem::round_size(requested), stream);
      events_pending = any_pending(segments);
    }
    Block* block = nullptr;
    try {
      block = alloc_.malloc(requested, stream);
    } catch (const OutOfMemoryError& e) {
      on_oom(e.info(), requested, stream, limit, backend_.ledger(0).refusals > before.refusals);
      return;
    }
    on_allocated(block, requested, stream);
    // With no pending frees to turn into cached blocks on the way, the choice is fully determined.
    if (!sampled || events_pending) return;
    const SimBackend::Ledger after = backend_.ledger(0);
    const bool new_memory = after.reserves > before.reserves || after.maps > before.maps;
    if (expected) {
      expect(block->addr == expected->addr, "malloc did not take the best-fitting cached block");
      expect(!new_memory, "malloc reserved or mapped memory although a cached block fit");
    } else {
      expect(new_memory, "malloc with no fitting cached block reserved and mapped nothing");
    }
  }

  void on_allocated(Block* block, std::size_t requested, StreamId stream) {
    const std::size_t rounded = gpumem::round_size(requested);
    expect(block->allocated, "malloc returned a block not marked allocated");
    expect(block->requested == requested, "the block does not record the requested size");
    expect(block->size >= rounded && block->size % gpumem::kMinBlockSize == 0, "block size is not the rounded request");
    expect(!gpumem::should_split(block->size, rounded), "block keeps a remainder that should have been split off");
    expect(block->stream == stream, "block serves another stream than the one asked for");
    expect(block->segment->small == gpumem::is_small(rounded), "block comes from the wrong size class");
    const auto segment = alloc_.segment_of(block->ptr());
    expect(segment && block->addr + block->size <= segment->first + segment->second, "block is not inside a segment");
    expect_no_overlap(block->addr, block->size);
    spans_.emplace(block->addr, block->size);
    live_.push_back({block, requested});
    allocated_ += block->size;
    requested_ += requested;
  }

  // The new block [addr, addr + size) against its neighbours among the live blocks.
  void expect_no_overlap(std::uintptr_t addr, std::size_t size) const {
    const auto next = spans_.lower_bound(addr);
    expect(next == spans_.end() || addr + size <= next->first, "new block overlaps the live block after it");
    if (next == spans_.begin()) return;
    const auto prev = std::prev(next);
    expect(prev->first + prev->second <= addr, "new block overlaps the live block before it");
  }

  void on_oom(const gpumem::OomInfo& info, std::size_t requested, StreamId stream, std::size_t limit,
              bool device_refused) {
    ++ooms_;
    const std::size_t rounded = gpumem::round_size(requested);
    expect(info.requested == requested, "OOM reports another request size");
    expect(info.allocated == allocated_, "OOM reports another allocated figure than the live blocks");
    expect(info.limit == limit, "OOM reports another limit");
    expect((info.kind == OomKind::kDeviceFull) == device_refused, "OOM says device full iff the device refused");
    if (info.kind == OomKind::kOverLimit) {
      expect(allocated_ + rounded > limit, "OOM over the limit although allocated + request fit under it");
    }
    if (info.kind == OomKind::kFragmentation) {
      expect(allocated_ + rounded <= limit, "OOM called fragmentation although the request is over the limit");
    }
    // Not spurious: no cached block could serve it, and the cap had no room for the smallest
    // segment that holds it, or (growable segments: every free page was unmapped first) for the
    // pages that hold it.
    expect(!best_cached(alloc_.snapshot(), rounded, stream), "OOM although a cached block on the stream fits");
    const std::size_t smallest = config_.page > 0 ? gpumem::round_up(rounded, config_.page) : gpumem::tight_segment_size(rounded);
    expect(device_refused || alloc_.reserved() + smallest > limit,
           "OOM although the smallest new memory for the request fits under the limit");
  }

  void do_free() {
    op_name_ = "free";
    const std::size_t i = draw(live_.size());
    const Live victim = live_[i];
    live_[i] = live_.back();
    live_.pop_back();
    spans_.erase(victim.block->addr);
    allocated_ -= victim.block->size;
    requested_ -= victim.requested;
    alloc_.free(victim.block);
  }

  void do_record_stream() {
    op_name_ = "record_stream";
    if (live_.empty()) return;
    alloc_.record_stream(live_[draw(live_.size())].block, draw(kStreams));
  }

  void do_empty_cache() {
    op_name_ = "empty_cache";
    alloc_.empty_cache();
    for (const SegmentInfo& s : alloc_.snapshot()) {
      expect(!is_unused(s), "empty_cache kept an unused segment");
      for (const BlockInfo& b : s.blocks) expect(b.state != BlockInfo::kPendingFree, "empty_cache kept a pending free");
    }
    if (live_.empty()) expect(alloc_.reserved() == 0, "empty_cache with no live blocks left memory reserved");
  }

  void do_set_limit() {
    op_name_ = "set_limit";
    const std::optional<std::size_t> limit = draw_limit();
    if (draw(2) == 0) {
      alloc_.set_limit(limit);
    } else {
      alloc_.set_limit(limit ? std::to_string(*limit) : std::string("none"));
    }
    max_limit_ = std::max(max_limit_, alloc_.limit());
    expect(alloc_.limit() == limit.value_or(kCapacity), "set_limit did not take the new limit");
    if (alloc_.reserved() > alloc_.limit()) {
      expect(!any_releasable(), "a lowered limit kept an unused segment or a free page while reserved is above it");
    }
  }

  void do_set_release_threshold() {
    op_name_ = "set_release_threshold";
    static constexpr double kShares[] = {0.0, 0.0, 0.5, 0.8, 1.0};
    alloc_.set_release_threshold(kShares[draw(std::size(kShares))]);
  }

  // Every operation that adds a segment or leaves one unused applies the release threshold, so
  // after any operation reserved is under it or nothing cached is left to give back.
  void expect_threshold_applied() {
    if (alloc_.settings().release_threshold == 0.0 || alloc_.reserved() <= threshold_target()) return;
    expect(!any_releasable(), "reserved stays above the release threshold with unused segments or free pages cached");
  }

  std::size_t threshold_target() const {
    return static_cast<std::size_t>(alloc_.settings().release_threshold * static_cast<double>(alloc_.limit()));
  }

  // Cached memory the allocator could give back: an unused plain segment, or a free block of a
  // growable segment that holds a whole chunk.
  bool any_releasable() const {
    const std::vector<SegmentInfo> segments = alloc_.snapshot();
    return std::any_of(segments.begin(), segments.end(), [this](const SegmentInfo& s) {
      if (!s.growable) return is_unused(s);
      return std::any_of(s.blocks.begin(), s.blocks.end(), [this](const BlockInfo& b) {
        return b.state == BlockInfo::kFree && backend_.holds_whole_chunk(0, b.addr, b.size);
      });
    });
  }

  void do_free_all() {
    op_name_ = "free all";
    for (const Live& live : live_) alloc_.free(live.block);
    live_.clear();
    spans_.clear();
    allocated_ = 0;
    requested_ = 0;
  }

  // ---- after every operation ----

  void check_after_op() {
    alloc_.check_invariants();
    expect_threshold_applied();
    const SimBackend::Ledger ledger = backend_.ledger(0);
    const std::size_t reserved = alloc_.reserved();
    const std::size_t limit = alloc_.limit();
    expect(ledger.in_use == reserved, "the device ledger and reserved() disagree");
    expect(ledger.peak <= max_limit_, "the device ledger peaked above every limit ever set");
    if (reserved_before_ > limit) {
      expect(reserved <= reserved_before_, "reserved grew while above a lowered limit");
    } else {
      expect(reserved <= limit, "reserved passed the limit");
    }
    const gpumem::DeviceStats stats = alloc_.stats();
    expect(stats.allocated_bytes[gpumem::kAll].current == static_cast<std::int64_t>(allocated_),
           "allocated bytes differ from the live blocks");
    expect(stats.requested_bytes[gpumem::kAll].current ==
               static_cast<std::int64_t>(requested_ + pending_requests(alloc_.snapshot())),
           "requested bytes differ from the live requests and those of pending frees");
    expect(stats.allocation[gpumem::kAll].current == static_cast<std::int64_t>(live_.size()),
           "allocation count differs from the live blocks");
    expect(stats.num_ooms == static_cast<std::int64_t>(ooms_), "num_ooms differs from the OOMs seen");
    expect(stats.reserved_bytes[gpumem::kAll].peak == static_cast<std::int64_t>(ledger.peak),
           "peak reserved bytes differ from the device ledger's peak");
    expect(stats.num_device_alloc == static_cast<std::int64_t>(ledger.reserves + ledger.maps) &&
               stats.num_device_free == static_cast<std::int64_t>(ledger.releases + ledger.unmaps),
           "device call counts differ from the device's reserve, map, release and unmap calls");
  }

  // Frees everything and lets every event complete; the caller checks that nothing is left.
  void finish() {
    op_name_ = "final free, complete_events, empty_cache";
    do_free_all();
    backend_.complete_events();
    alloc_.empty_cache();
    alloc_.check_invariants();
  }

  const Config config_;
  SimBackend backend_;
  DeviceAllocator alloc_;
  std::mt19937_64 rng_;
  std::vector<Live> live_;
  std::map<std::uintptr_t, std::size_t> spans_;  // live blocks: address -> size
  std::size_t allocated_ = 0;
  std::size_t requested_ = 0;
  std::size_t ooms_ = 0;
  std::size_t max_limit_;
  std::size_t reserved_before_ = 0;
  std::size_t op_index_ = 0;
  const char* op_name_ = "";
  std::size_t malloc_share_ = 3950;  // of the 7,900 per 10,000 that are malloc or free
};

void run_configs(const SizeMix& mix, int mix_index, std::size_t page) {
  const std::uint64_t base_seed = env_number("GPUMEM_PROPERTY_SEED", 0x5eed);
  const Config configs[kConfigsPerMix] = {
      {mix, "tight", mix.tight, base_seed + 10 * mix_index + 0, page},
      {mix, "medium", mix.medium, base_seed + 10 * mix_index + 1, page},
      {mix, "none", std::nullopt, base_seed + 10 * mix_index + 2, page},
  };
  const std::size_t ops = ops_per_config();
  for (const Config& config : configs) {
    INFO("seed " << config.seed << ", " << mix.name << ", limit " << config.limit_name
                 << (page > 0 ? ", growable segments" : ", plain segments")
                 << " (GPUMEM_PROPERTY_SEED=" << base_seed << " reruns it)");
    PropertyRun run(config);
    try {
      run.run(ops);
    } catch (const std::exception& e) {
      FAIL(run.where() << ": " << e.what());
    }
    // Everything freed, every event complete, the cache emptied: nothing is left anywhere.
    const SimBackend::Ledger ledger = run.ledger();
    REQUIRE(run.allocator().reserved() == 0);
    REQUIRE(ledger.in_use == 0);
    REQUIRE(ledger.live_events == 0);
    REQUIRE(ledger.reserves == ledger.releases);
    REQUIRE(ledger.mapped == 0);
    REQUIRE(ledger.address_ranges == 0);
    for (const auto& [name, value] : gpumem::flatten(run.allocator().stats())) {
      if (name.size() > 8 && name.compare(name.size() - 8, 8, ".current") == 0) {
        INFO(name);
        REQUIRE(value == 0);
      }
    }
  }
}

}  // namespace

TEST_CASE("random operations on small requests keep every invariant, under tight, medium and no limits", "[property]") {
  run_configs(kSmallOnly, 0, 0);
}

TEST_CASE("random operations on mixed sizes keep every invariant, under tight, medium and no limits", "[property]") {
  run_configs(kMixed, 1, 0);
}

TEST_CASE("random operations on large requests keep every invariant, under tight, medium and no limits", "[property]") {
  run_configs(kLargeOnly, 2, 0);
}

TEST_CASE("random operations on small requests keep every invariant with growable segments", "[property][growable]") {
  run_configs(kSmallOnly, 3, kPage);
}

TEST_CASE("random operations on mixed sizes keep every invariant with growable segments", "[property][growable]") {
  run_configs(kMixed, 4, kPage);
}

TEST_CASE("random operations on large requests keep every invariant with growable segments", "[property][growable]") {
  run_configs(kLargeOnly, 5, kPage);
}
