// The hard cap on one device's reserved bytes.
//
// Bytes are counted as reserved before the backend is asked for them and given back if it refuses
// (reserve, ask, roll back: Cap::grow, the one place that rule is written), so reserved never
// passes the limit, not by one byte, whatever the threads do. Lowering the limit below what is reserved is allowed: nothing grows until reserved
// is under it again.
//
// The cap also carries the device's pressure watches (core/pressure.h): every change of reserved
// and of the limit goes through here, so none can pass them by.
//
// Under a limit on the whole process (LimitScope::kProcess) the cap also counts `outside`: what the
// driver counts for the process on the device beyond the allocator's reserved bytes (the CUDA
// context, library workspaces, NCCL's buffers). Reserved may then grow only to the budget, limit -
// outside, and the watches measure reserved + outside against the limit. The device allocator
// measures outside (Note [a limit on the whole process], core/process_scope.cpp); under the
// default scope it stays 0.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "core/pressure.h"

namespace gpumem {

// Why Cap::grow got nothing: the cap would pass the budget, or the device had no memory for it.
enum class Refusal { kNone, kCap, kDevice };
template <class T>
struct Capped {
  T got{};
  Refusal refusal = Refusal::kNone;
};

class Cap {
 public:
  explicit Cap(std::size_t limit) : limit_(limit) {}

  // Counts `bytes` as reserved if reserved + bytes stays within the budget.
  bool try_reserve(std::size_t bytes) {
    std::size_t current = reserved_.load(std::memory_order_relaxed);
    do {
      const std::size_t limit = budget();
      if (current > limit || bytes > limit - current) return false;
    } while (!reserved_.compare_exchange_weak(current, current + bytes, std::memory_order_relaxed));
    return true;
  }

  // The cap's rule, for every way of getting memory (a segment from a pool's source, pages of a
  // growable segment, uncached memory): count `bytes` first, then ask the device (`ask` returns a
  // pointer or a bool); if it refuses or throws, the bytes are given back.
  template <class Ask>
  auto grow(std::size_t bytes, Ask&& ask) -> Capped<decltype(ask())> {
    if (!try_reserve(bytes)) return {{}, Refusal::kCap};
    decltype(ask()) got{};
    try {
      got = ask();
    } catch (...) {
      unreserve(bytes);
      throw;
    }
    if (!got) {
      unreserve(bytes);
      return {got, Refusal::kDevice};
    }
    grown();
    return {got, Refusal::kNone};
  }
  // The same, noting a refusal by the device in `device_refused` (a request's, or the uncached
  // path's): it makes the out-of-memory error "device full".
  template <class Ask>
  auto grow_noting(bool& device_refused, std::size_t bytes, Ask&& ask) -> decltype(ask()) {
    auto result = grow(bytes, std::forward<Ask>(ask));
    if (result.refusal == Refusal::kDevice) device_refused = true;
    return result.got;
  }

  // The device handed out the memory try_reserve counted. Not told in try_reserve itself: a
  // reservation the device then refuses is rolled back, and must not count as a crossing.
  void grown() { counted_grew(); }

  void unreserve(std::size_t bytes) {
    reserved_.fetch_sub(bytes, std::memory_order_relaxed);
    pressure_.shrank(counted());
  }

  void set_limit(std::size_t limit) {
    limit_.store(limit, std::memory_order_relaxed);
    pressure_.set_limit(limit, counted());
  }
  // What the process holds on the device besides the reserved bytes, as last measured.
  void set_outside(std::size_t bytes) {
    const std::size_t before = outside_.exchange(bytes, std::memory_order_relaxed);
    if (bytes > before) counted_grew();
    if (bytes < before) pressure_.shrank(counted());
  }
  std::size_t limit() const { return limit_.load(std::memory_order_relaxed); }
  std::size_t reserved() const { return reserved_.load(std::memory_order_relaxed); }
  std::size_t outside() const { return outside_.load(std::memory_order_relaxed); }
  // What reserved may grow to under the hard cap: the limit less what is outside, 0 if that is more.
  std::size_t hard_budget() const {
    const std::size_t limit = this->limit(), out = outside();
    return out < limit ? limit - out : 0;
  }
  // What reserved may grow to: the hard budget, or less where sharing the GPU leaves less.
  std::size_t budget() const { return std::min(hard_budget(), ceiling_.load(std::memory_order_relaxed)); }
  // What the other processes sharing the GPU leave this one (sharing/policy.h); SIZE_MAX: no sharing.
  void set_ceiling(std::size_t bytes) { ceiling_.store(bytes, std::memory_order_relaxed); }
  // Reserved and outside, as the limit measures them (saturating: both are at most 2^64 - 1).
  std::size_t counted() const {
    const std::size_t r = reserved(), out = outside();
    return out > SIZE_MAX - r ? SIZE_MAX : r + out;
  }

  // The most counted() reached since the start or the last reset_peak(): the peak of what the limit
  // measures, kept beside it (under the allocator scope, reserved's; the statistics keep their own).
  std::size_t counted_peak() const { return std::max(counted_peak_.load(std::memory_order_relaxed), counted()); }
  void reset_peak() { counted_peak_.store(counted(), std::memory_order_relaxed); }

  void watch_pressure(int slot, double share) { pressure_.watch(slot, share, limit(), counted()); }
  const PressureWatches& pressure() const { return pressure_; }

 private:
  void counted_grew() {
    const std::size_t now = counted();
    std::size_t peak = counted_peak_.load(std::memory_order_relaxed);
    while (now > peak && !counted_peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    pressure_.grew(now);
  }

  std::atomic<std::size_t> limit_;
  std::atomic<std::size_t> reserved_{0};
  std::atomic<std::size_t> outside_{0};
  std::atomic<std::size_t> ceiling_{SIZE_MAX};
  std::atomic<std::size_t> counted_peak_{0};
  PressureWatches pressure_;
};

// allocated + size <= limit, without overflow (size may be near SIZE_MAX; the limit may have been
// lowered below allocated).
inline bool fits_under(std::size_t allocated, std::size_t size, std::size_t limit) {
  return allocated <= limit && size <= limit - allocated;
}

}  // namespace gpumem
