// The hard cap on one device's reserved bytes.
//
// Bytes are counted as reserved before the backend is asked for them and given back if it refuses
// (reserve, ask, roll back), so reserved never passes the limit, not by one byte, whatever the
// threads do. Lowering the limit below what is reserved is allowed: nothing grows until reserved
// is under it again.
//
// The cap also carries the device's pressure watches (core/pressure.h): every change of reserved
// and of the limit goes through here, so none can pass them by.
#pragma once

#include <atomic>
#include <cstddef>

#include "core/pressure.h"

namespace gpumem {

class Cap {
 public:
  explicit Cap(std::size_t limit) : limit_(limit) {}

  // Counts `bytes` as reserved if reserved + bytes stays within the limit.
  bool try_reserve(std::size_t bytes) {
    std::size_t current = reserved_.load(std::memory_order_relaxed);
    do {
      const std::size_t limit = limit_.load(std::memory_order_relaxed);
      if (current > limit || bytes > limit - current) return false;
    } while (!reserved_.compare_exchange_weak(current, current + bytes, std::memory_order_relaxed));
    return true;
  }

  // The device handed out the memory try_reserve counted. Not told in try_reserve itself: a
  // reservation the device then refuses is rolled back, and must not count as a crossing.
  void grown() { pressure_.grew(reserved()); }

  void unreserve(std::size_t bytes) {
    pressure_.shrank(reserved_.fetch_sub(bytes, std::memory_order_relaxed) - bytes);
  }

  void set_limit(std::size_t limit) {
    limit_.store(limit, std::memory_order_relaxed);
    pressure_.set_limit(limit, reserved());
  }
  std::size_t limit() const { return limit_.load(std::memory_order_relaxed); }
  std::size_t reserved() const { return reserved_.load(std::memory_order_relaxed); }

  void watch_pressure(int slot, double share) { pressure_.watch(slot, share, limit(), reserved()); }
  const PressureWatches& pressure() const { return pressure_; }

 private:
  std::atomic<std::size_t> limit_;
  std::atomic<std::size_t> reserved_{0};
  PressureWatches pressure_;
};

// allocated + size <= limit, without overflow (size may be near SIZE_MAX; the limit may have been
// lowered below allocated).
inline bool fits_under(std::size_t allocated, std::size_t size, std::size_t limit) {
  return allocated <= limit && size <= limit - allocated;
}

}  // namespace gpumem
