// Pressure watches (core/pressure.h): setting watches and their marks, and counting crossings of a share of the limit.
#include "core/pressure.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "core/errors.h"

namespace gpumem {

void check_pressure_share(double share) {
  if (!(share > 0.0 && share <= 1.0)) {
    throw LimitSpecError({"pressure share", std::to_string(share), "it is not a share of the limit",
                          "a share of the limit in (0, 1], such as 0.85", ""});
  }
}

namespace {

// `share` of `limit` in bytes, to the nearest byte (0.85 - 0.05 is 0.7999999999999999 in binary:
// its mark on a 1000-byte limit is 800, not 799), never above the limit (nor past 2^64).
std::size_t share_of(double share, std::size_t limit) {
  const double bytes = std::round(share * static_cast<double>(limit));
  return bytes >= static_cast<double>(limit) ? limit : static_cast<std::size_t>(bytes);
}

}  // namespace

void PressureWatches::watch(int slot, double share, std::size_t limit, std::size_t reserved) {
  check_pressure_share(share);
  if (slot < 0 || slot >= kMaxPressureWatches) throw std::out_of_range("gpumem: pressure watch slot out of range");
  Watch& w = watches_[slot];
  if (w.share.load(std::memory_order_relaxed) == share) return;
  w.share.store(share, std::memory_order_relaxed);
  set_marks(w, limit);
  w.armed.store(true, std::memory_order_relaxed);
  w.crossings.store(0, std::memory_order_relaxed);
  w.reserved_at_crossing.store(0, std::memory_order_relaxed);
  update_bounds();
  grew(reserved);  // already past the mark: that counts, as a growth to it would
}

void PressureWatches::set_limit(std::size_t limit, std::size_t reserved) {
  for (Watch& w : watches_) {
    if (w.share.load(std::memory_order_relaxed) != 0.0) set_marks(w, limit);
  }
  update_bounds();
  shrank(reserved);
  grew(reserved);
}

void PressureWatches::set_marks(Watch& w, std::size_t limit) {
  const double share = w.share.load(std::memory_order_relaxed);
  w.high.store(std::max<std::size_t>(share_of(share, limit), 1), std::memory_order_relaxed);
  w.low.store(share_of(std::max(share - kPressureRearmGap, 0.0), limit), std::memory_order_relaxed);
}

void PressureWatches::count_crossings(std::size_t reserved) {
  for (Watch& w : watches_) {
    if (!w.armed.load(std::memory_order_relaxed) || reserved < w.high.load(std::memory_order_relaxed)) continue;
    w.armed.store(false, std::memory_order_relaxed);
    w.reserved_at_crossing.store(reserved, std::memory_order_relaxed);
    w.crossings.fetch_add(1, std::memory_order_release);  // after reserved_at_crossing, for for_each
  }
  update_bounds();
}

void PressureWatches::rearm(std::size_t reserved) {
  for (Watch& w : watches_) {
    if (reserved <= w.low.load(std::memory_order_relaxed)) w.armed.store(true, std::memory_order_relaxed);
  }
  update_bounds();
}

void PressureWatches::update_bounds() {
  std::size_t lowest_high = kNever, highest_low = 0;
  for (const Watch& w : watches_) {
    if (w.share.load(std::memory_order_relaxed) == 0.0) continue;
    if (w.armed.load(std::memory_order_relaxed)) {
      lowest_high = std::min(lowest_high, w.high.load(std::memory_order_relaxed));
    } else {
      highest_low = std::max(highest_low, w.low.load(std::memory_order_relaxed));
    }
  }
  lowest_high_.store(lowest_high, std::memory_order_relaxed);
  highest_low_.store(highest_low, std::memory_order_relaxed);
}

}  // namespace gpumem
