// Statistics of one device, declared once.
//
// GPUMEM_STAT_ARRAYS and GPUMEM_STAT_COUNTERS are the single list: the struct below, the resets,
// the recomputation in the invariant checker's comparison and the Python dict (keys like
// "allocated_bytes.all.current", as in torch.cuda.memory_stats) all expand from them. Meanings
// match PyTorch's native allocator so the torch adapter maps them one to one:
//   allocation / allocated_bytes         blocks handed out and not yet freed by the caller
//   segment / reserved_bytes             segments obtained from the device
//   active / active_bytes                allocated blocks plus freed blocks still in use on a stream
//   inactive_split / inactive_split_bytes free blocks that share a segment with other blocks
//   requested_bytes                      bytes the callers asked for, before rounding, of active blocks
// num_ooms counts every out-of-memory failure; num_ooms_over_limit, _device_full and _fragmentation
// split it by the error's case (OomKind), so they add up to it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/errors.h"

// X(name, help)
#define GPUMEM_STAT_ARRAYS(X)                                                        \
  X(allocation, "blocks allocated")                                                  \
  X(segment, "segments reserved from the device")                                    \
  X(active, "allocated blocks and freed blocks still used by a stream")              \
  X(inactive_split, "free blocks that share a segment with other blocks")            \
  X(allocated_bytes, "bytes in allocated blocks")                                    \
  X(reserved_bytes, "bytes in segments reserved from the device")                    \
  X(active_bytes, "bytes in active blocks")                                          \
  X(inactive_split_bytes, "bytes in inactive split blocks")                          \
  X(requested_bytes, "bytes requested by callers, before rounding")

#define GPUMEM_STAT_COUNTERS(X)                                                             \
  X(num_alloc_retries, "requests that released cached memory and tried again")              \
  X(num_ooms, "requests that failed with out-of-memory")                                    \
  X(num_ooms_over_limit, "of those: allocated plus the request over the limit")             \
  X(num_ooms_device_full, "of those: under the limit, but the device had no memory left")   \
  X(num_ooms_fragmentation, "of those: under the limit, but no block or segment fit")       \
  X(num_sync_all_streams, "waits for all streams before releasing all the cache")           \
  X(num_device_alloc, "segments obtained from the device")                                  \
  X(num_device_free, "segments returned to the device")                                     \
  X(num_cache_releases, "times cached segments were released (policy, empty_cache, limit)")

namespace gpumem {

struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // accumulated increases
  std::int64_t freed = 0;      // accumulated decreases

  // For statistics recomputed from the blocks (the invariant checker); the allocator's own go
  // through StatLedger's events.
  void increase(std::int64_t amount) {
    current += amount;
    peak = current > peak ? current : peak;
    allocated += amount;
  }
};

enum StatType : int { kAll = 0, kSmallPool = 1, kLargePool = 2, kNumStatTypes = 3 };
extern const char* const kStatTypeNames[kNumStatTypes];  // "all", "small_pool", "large_pool"

using StatArray = std::array<Stat, kNumStatTypes>;

struct DeviceStats {
#define GPUMEM_DECLARE_ARRAY(name, help) StatArray name;
  GPUMEM_STAT_ARRAYS(GPUMEM_DECLARE_ARRAY)
#undef GPUMEM_DECLARE_ARRAY
#define GPUMEM_DECLARE_COUNTER(name, help) std::int64_t name = 0;
  GPUMEM_STAT_COUNTERS(GPUMEM_DECLARE_COUNTER)
#undef GPUMEM_DECLARE_COUNTER

};

// Raises the "all" entry and the pool's entry by `amount` (>= 0): how the invariant checker adds
// up what the blocks hold.
inline void increase_stat(StatArray& stat, bool small_pool, std::int64_t amount) {
  stat[kAll].increase(amount);
  stat[small_pool ? kSmallPool : kLargePool].increase(amount);
}

// The statistics as a device allocator keeps them: changed only through the named events below,
// each of which moves every figure it concerns at once, and read as a DeviceStats (snapshot()).
//
// Kept compact for the cached path, where a malloc+free pair is a hand_out, a release, a settle
// and at most two split_change events. Per figure the ledger keeps each pool's current value, peak and accumulated
// decreases, and the whole's peak; everything else is derived where it is read:
//   - the whole's current and accumulated figures are the sums of the pools' (what native keeps);
//   - accumulated increases = current - current at the last reset_accumulated() + decreases, so an
//     increase writes the current and the peak only;
//   - active = allocation + pending, where pending counts the blocks the caller freed that a stream
//     still uses (stream events outstanding, or held while a graph captures). A block freed with no
//     stream using it leaves allocation and active in one event, and a cached pair never touches
//     a figure of its own for active. Active's peak is allocation's peak except while some block is
//     pending: then hand_out raises a peak of its own (in active_), and the read takes the larger.
//     Active only grows at hand_out, so that is exact.
// One branch per event picks the pool. The counters (num_*) move with their events too: reserve
// and unreserve count the device's allocations and frees; the rest are counted events. Reserved
// and the counters change only through the device's accounts (core/accounts.h).
//
// A device keeps one ledger, written under the whole device, and each lane one more, written by
// the lane's cached path under the lane's lock: what its events moved since the device's ledger
// last took it in (take_in), so each of its currents is a change, and each peak the highest that
// change reached (core/lane_ledgers.h says when they are taken in, and what a peak then is).
class StatLedger {
 public:
  // A block handed out to a caller: allocated and active; `requested` bytes asked for.
  void hand_out(bool small, std::size_t size, std::size_t requested) {
    const int t = pool(small);
    allocation_.increase(t, 1);
    allocated_bytes_.increase(t, static_cast<std::int64_t>(size));
    requested_bytes_.increase(t, static_cast<std::int64_t>(requested));
    if (pending_.current[0] != 0 || pending_.current[1] != 0) note_active_peak(t);
  }
  // The caller freed it: no longer allocated. Unless pend() follows, it is no longer active either.
  void release(bool small, std::size_t size) {
    const int t = pool(small);
    allocation_.decrease(t, 1);
    allocated_bytes_.decrease(t, static_cast<std::int64_t>(size));
  }
  // The freed block is free again (at once, or when no stream uses it any more): its request no
  // longer counts. Native keeps a pending block's request until then too.
  void settle(bool small, std::size_t requested) {
    requested_bytes_.decrease(pool(small), static_cast<std::int64_t>(requested));
  }
  // The freed block is still used by a stream: it stays active until retire(). Active does not
  // change (it leaves allocation as it enters pending), so no peak moves.
  void pend(bool small, std::size_t size) {
    const int t = pool(small);
    pending_.current[t] += 1;
    pending_bytes_.current[t] += static_cast<std::int64_t>(size);
  }
  // A pending block no stream uses any more: no longer active.
  void retire(bool small, std::size_t size) {
    const int t = pool(small);
    pending_.decrease(t, 1);
    pending_bytes_.decrease(t, static_cast<std::int64_t>(size));
  }
  // The free blocks that share a plain segment with other blocks changed by `blocks` and `bytes`
  // (either may be negative): one malloc's or one free's net change, as native counts it, so the
  // accumulated figures move by the net amount. Growable segments are not counted: their free
  // pages can always go back to the device (native leaves expandable segments out too).
  void split_change(bool small, std::int64_t blocks, std::int64_t bytes) {
    const int t = pool(small);
    inactive_split_.change(t, blocks);
    inactive_split_bytes_.change(t, bytes);
  }

  // Whether a freed block is still used by a stream (then hand_out also moves active's own peak).
  bool any_pending() const { return pending_.current[0] != 0 || pending_.current[1] != 0; }
  std::int64_t allocated_bytes() const { return allocated_bytes_.whole(); }  // all pools, now
  std::int64_t reserved_bytes() const { return reserved_bytes_.whole(); }

  DeviceStats snapshot() const;
  // Takes in the changes `lanes` hold (ledgers of lanes, as above) and clears them: every current
  // and accumulated figure moves by the sum of theirs; a peak becomes at least the current before
  // plus the sum of the lanes' highest changes (exact where one lane has changes: their order is
  // its own; with several, the highest the whole could have reached).
  static constexpr int kMaxParts = 16;  // the most ledgers take_in takes at once
  void take_in(StatLedger* const* lanes, int count);
  void reset_peak();
  void reset_accumulated();  // the accumulated figures and the counters

 private:
  friend class Accounts;  // the only writer of reserved and of the counters

  // Memory obtained from the device, or given back to it: `bytes` (each time any, one allocation or
  // free from the device), in `segments` new or whole segments (0 for pages mapped into, or
  // unmapped from, a growable segment that stays; no bytes for its address range alone).
  void reserve(bool small, std::size_t bytes, int segments) {
    const int t = pool(small);
    if (segments > 0) segment_.increase(t, segments);
    if (bytes == 0) return;
    reserved_bytes_.increase(t, static_cast<std::int64_t>(bytes));
    ++num_device_alloc_;
  }
  void unreserve(bool small, std::size_t bytes, int segments) {
    const int t = pool(small);
    if (segments > 0) segment_.decrease(t, segments);
    if (bytes == 0) return;
    reserved_bytes_.decrease(t, static_cast<std::int64_t>(bytes));
    ++num_device_free_;
  }
  void count_retry() { ++num_alloc_retries_; }
  void count_oom(OomKind kind) {
    ++num_ooms_;
    switch (kind) {
      case OomKind::kOverLimit: ++num_ooms_over_limit_; break;
      case OomKind::kDeviceFull: ++num_ooms_device_full_; break;
      case OomKind::kFragmentation: ++num_ooms_fragmentation_; break;
    }
  }
  void count_sync_all_streams() { ++num_sync_all_streams_; }
  void count_cache_release() { ++num_cache_releases_; }

#define GPUMEM_DECLARE_COUNTER(name, help) std::int64_t name##_ = 0;
  GPUMEM_STAT_COUNTERS(GPUMEM_DECLARE_COUNTER)
#undef GPUMEM_DECLARE_COUNTER

  // One figure: per pool (0 small, 1 large) and for the whole.
  struct Figure {
    std::int64_t current[2] = {0, 0};
    std::int64_t peak[2] = {0, 0};
    std::int64_t decreased[2] = {0, 0};
    std::int64_t base[2] = {0, 0};  // current at the last reset_accumulated()
    std::int64_t whole_peak = 0;

    std::int64_t whole() const { return current[0] + current[1]; }
    std::int64_t increased(int t) const { return current[t] - base[t] + decreased[t]; }
    // The peaks are written only when passed: in a steady state, never (a compare and a branch).
    void increase(int t, std::int64_t amount) {
      const std::int64_t now = current[t] += amount;
      if (now > peak[t]) peak[t] = now;
      const std::int64_t all = now + current[1 - t];
      if (all > whole_peak) whole_peak = all;
    }
    void decrease(int t, std::int64_t amount) {
      current[t] -= amount;
      decreased[t] += amount;
    }
    void change(int t, std::int64_t amount) {
      if (amount > 0) {
        increase(t, amount);
      } else if (amount < 0) {
        decrease(t, -amount);
      }
    }
    StatArray read() const;
    void reset_peak();
    void reset_accumulated();
    void take_in(Figure* const* parts, int count);
  };
  static int pool(bool small) { return small ? 0 : 1; }
  void note_active_peak(int t);
  // Active from allocation, pending and active's own peaks (`own`: only its peaks are used).
  static StatArray read_active(const Figure& allocated, const Figure& pending, const Figure& own);
  static void reset_active_peak(Figure& own, const Figure& allocated, const Figure& pending);

  // active_ and active_bytes_ hold only active's own peaks; the rest of active is derived.
#define GPUMEM_DECLARE_FIGURE(name, help) Figure name##_;
  GPUMEM_STAT_ARRAYS(GPUMEM_DECLARE_FIGURE)
#undef GPUMEM_DECLARE_FIGURE
  Figure pending_;  // freed blocks still used by a stream: the part of active not allocated
  Figure pending_bytes_;
};

// Flat view: ("allocated_bytes.all.current", value) ... then ("num_ooms", value) ...
using StatEntry = std::pair<std::string, std::int64_t>;
std::vector<StatEntry> flatten(const DeviceStats& stats);

}  // namespace gpumem
