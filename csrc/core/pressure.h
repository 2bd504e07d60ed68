// Alerts at a share of the limit: per-device watches that count when reserved bytes cross a mark.
//
// A watch at share s of the limit L has two marks:
//   high = s * L (at least 1)                 reserved >= high while armed is a crossing: it is
//                                             counted and the watch disarms
//   low  = max(s - kPressureRearmGap, 0) * L  reserved <= low re-arms the watch
// both to the nearest byte, so a job hovering at the edge counts one crossing, not one per segment
// it maps. Reserved is checked against the marks when it grows, when it shrinks, and when a watch
// or a limit is set (a watch set, or a limit lowered, while reserved is already past the high mark
// counts a crossing at once). Invariant: a watch is disarmed only after a crossing, until reserved
// is seen at or below its low mark.
//
// Only counting happens here. Acting on a crossing (a Python callback, a log line) is done by
// whoever polls for_each(), outside the allocator: never with its lock held. The watches are told
// of growth where the device handed out new memory (Cap::grown, from Cap::grow),
// never on the cached path; with no armed watch at or below reserved that is one relaxed load and
// a compare. Changes (watch, set_limit, grew, shrank) come from one thread at a time: the device's
// lock is held. The counts are atomics, so for_each reads them from any thread without the lock.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace gpumem {

constexpr int kMaxPressureWatches = 8;
constexpr double kPressureRearmGap = 0.05;

// Throws LimitSpecError unless `share` is in (0, 1].
void check_pressure_share(double share);

struct PressureCount {
  double share;
  std::uint64_t crossings;
  std::size_t reserved_at_crossing;  // reserved right after the last crossing (with what is outside, under a process-wide limit)
};

class PressureWatches {
 public:
  // Starts watching slot `slot` (0 <= slot < kMaxPressureWatches) at `share`, armed. Watching a
  // slot again at the same share changes nothing; its counts are kept.
  void watch(int slot, double share, std::size_t limit, std::size_t reserved);
  // Recomputes the marks for a new limit.
  void set_limit(std::size_t limit, std::size_t reserved);

  // Reserved grew to `reserved`.
  void grew(std::size_t reserved) {
    if (reserved >= lowest_high_.load(std::memory_order_relaxed)) count_crossings(reserved);
  }
  // Reserved shrank to `reserved`.
  void shrank(std::size_t reserved) {
    if (reserved <= highest_low_.load(std::memory_order_relaxed)) rearm(reserved);
  }

  // The watched slots' counts, in slot order; a slot never watched is left out.
  template <class F>
  void for_each(F f) const {
    for (const Watch& w : watches_) {
      const double share = w.share.load(std::memory_order_relaxed);
      if (share == 0.0) continue;
      const std::uint64_t crossings = w.crossings.load(std::memory_order_acquire);
      f(PressureCount{share, crossings, w.reserved_at_crossing.load(std::memory_order_relaxed)});
    }
  }

 private:
  static constexpr std::size_t kNever = std::numeric_limits<std::size_t>::max();
  struct Watch {
    std::atomic<double> share{0.0};  // 0: not watched
    std::atomic<std::size_t> high{kNever};
    std::atomic<std::size_t> low{0};
    std::atomic<bool> armed{true};
    std::atomic<std::uint64_t> crossings{0};
    std::atomic<std::size_t> reserved_at_crossing{0};
  };

  void count_crossings(std::size_t reserved);
  void rearm(std::size_t reserved);
  void set_marks(Watch& w, std::size_t limit);
  void update_bounds();

  std::array<Watch, kMaxPressureWatches> watches_;
  std::atomic<std::size_t> lowest_high_{kNever};  // the smallest high mark of an armed watch
  std::atomic<std::size_t> highest_low_{0};       // the largest low mark of a disarmed watch
};

}  // namespace gpumem
