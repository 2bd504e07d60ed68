// The accounts of one device: the cap (core/cap.h) and the statistics (core/stats.h), which change
// only through the events below, each moving every figure it concerns at once.
//
//   memory from the device     map_segment, map_pages, map_uncached: under the cap (counted first,
//                              rolled back if the device refuses: Cap::grow), then reserved in the
//                              statistics, num_device_alloc counted, the high mark noted
//   memory back to the device  unmap_segment, unmap_pages, unmap_uncached; a plain segment leaving
//                              after the lock is let go leaves the statistics at once
//                              (segment_departing) and the cap once it is back (departed)
//   address ranges             open_segment, close_segment: a growable segment, no memory
//   blocks                     the ledger's own events (hand_out, release, pend, retire, settle,
//                              split_change), on the device's ledger or a lane's (core/lanes.h)
//   counted events             retried, oom, synced_all_streams, released_cache
//
// So reserved in the statistics equals the cap's reserved, less the bytes departing (the invariant
// checker holds them to it), and no counter is bumped by hand. The limit's side (set_limit,
// set_outside, set_ceiling, watch_pressure) changes what reserved may grow to, never reserved.
// Written under the whole device, as the ledger is; the cap's figures are read lock-free.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>

#include "core/cap.h"
#include "core/stats.h"

namespace gpumem {

class Accounts {
 public:
  Accounts() : cap_(0) {}
  Accounts(const Accounts&) = delete;
  Accounts& operator=(const Accounts&) = delete;

  const Cap& cap() const { return cap_; }
  StatLedger& ledger() { return stats_; }
  const StatLedger& ledger() const { return stats_; }
  // The most ever reserved by segments, pages and uncached memory (not reset with the statistics).
  std::size_t reserved_high() const { return reserved_high_; }

  // ---- the limit
  void set_limit(std::size_t limit) { cap_.set_limit(limit); }
  void set_outside(std::size_t bytes) { cap_.set_outside(bytes); }
  void set_ceiling(std::size_t bytes) { cap_.set_ceiling(bytes); }
  void watch_pressure(int slot, double share) { cap_.watch_pressure(slot, share); }
  void reset_peaks() {
    stats_.reset_peak();
    cap_.reset_peak();
  }

  // ---- memory from the device: `ask` returns what the device gave (a pointer, or a bool), or
  // nothing if it refused (noted in `device_refused`); the cap refusing returns nothing too.
  // A plain segment of `bytes`.
  template <class Ask>
  auto map_segment(bool& device_refused, bool small, std::size_t bytes, Ask&& ask) -> decltype(ask()) {
    auto got = cap_.grow_noting(device_refused, bytes, std::forward<Ask>(ask));
    if (got) mapped(small, bytes, 1);
    return got;
  }
  // Pages mapped into a growable segment that stays.
  template <class Ask>
  auto map_pages(bool& device_refused, bool small, std::size_t bytes, Ask&& ask) -> decltype(ask()) {
    auto got = cap_.grow_noting(device_refused, bytes, std::forward<Ask>(ask));
    if (got) mapped(small, bytes, 0);
    return got;
  }
  // Memory handed out while caching is off: a segment of the large pool holding one allocated
  // block (Note [caching off in the statistics], core/uncached.h).
  template <class Ask>
  void* map_uncached(bool& device_refused, std::size_t bytes, std::size_t requested, Ask&& ask) {
    void* ptr = map_segment(device_refused, false, bytes, std::forward<Ask>(ask));
    if (ptr) stats_.hand_out(false, bytes, requested);
    return ptr;
  }

  // ---- memory back to the device
  void unmap_segment(bool small, std::size_t bytes) {
    stats_.unreserve(small, bytes, 1);
    cap_.unreserve(bytes);
  }
  void unmap_pages(bool small, std::size_t bytes) {
    stats_.unreserve(small, bytes, 0);
    cap_.unreserve(bytes);
  }
  void unmap_uncached(std::size_t bytes, std::size_t requested) {
    stats_.release(false, bytes);
    stats_.settle(false, requested);
    unmap_segment(false, bytes);
  }
  // A plain segment given back after the lock is let go (core/departures.h): the cap counts it
  // until departed().
  void segment_departing(bool small, std::size_t bytes) { stats_.unreserve(small, bytes, 1); }
  void departed(std::size_t bytes) { cap_.unreserve(bytes); }

  // ---- a growable segment's address range: a segment, no memory
  void open_segment(bool small) { stats_.reserve(small, 0, 1); }
  void close_segment(bool small) { stats_.unreserve(small, 0, 1); }

  // ---- counted events
  void retried() { stats_.count_retry(); }
  void oom(OomKind kind) { stats_.count_oom(kind); }
  void synced_all_streams() { stats_.count_sync_all_streams(); }
  void released_cache() { stats_.count_cache_release(); }

 private:
  void mapped(bool small, std::size_t bytes, int segments) {
    stats_.reserve(small, bytes, segments);
    reserved_high_ = std::max(reserved_high_, cap_.reserved());
  }

  Cap cap_;
  StatLedger stats_;  // exact under the whole device: it takes in the lanes' when that is taken
  std::size_t reserved_high_ = 0;
};

}  // namespace gpumem
