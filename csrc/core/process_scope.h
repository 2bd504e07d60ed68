// What a device's limit bounds (LimitScope) and, under a limit on the whole process, the memory
// the process holds on the device outside the allocator: measured here, counted by the cap
// (Cap::set_outside), which then lets reserved grow only to limit - outside.
// Note [a limit on the whole process] (core/process_scope.cpp) says how and when it is measured.
#pragma once

#include <atomic>

#include "core/device_state.h"

namespace gpumem {

// What a device's limit bounds. kAllocator: the bytes the allocator reserves (segments and
// uncached memory). kProcess: everything the driver counts for the process on the device, the
// allocator's reserved bytes plus what it does not hold (Note [a limit on the whole process]).
enum class LimitScope { kAllocator, kProcess };
const char* limit_scope_name(LimitScope scope);  // "allocator", "process"

// Where the memory outside the allocator, under LimitScope::kProcess, was last measured from.
enum class OutsideSource {
  kNone,               // not measured: the scope is kAllocator, or nothing grew since it was set
  kProcessAccounting,  // the driver's figure for this process (NVML), at the last growth
  kDeviceAtFirst,      // the device's used memory at the first measurement: no per-process figure
};
const char* outside_source_name(OutsideSource source);  // "none", "process accounting", "device at first use"

class ProcessScope {
 public:
  explicit ProcessScope(LimitScope scope) : scope_(scope) {}

  LimitScope scope() const { return scope_; }
  // Sets the scope; kAllocator forgets what was measured (the cap's outside becomes 0).
  void set(DeviceState& d, LimitScope scope);
  OutsideSource source() const { return source_.load(std::memory_order_relaxed); }  // lock-free
  // Measures outside into the cap under kProcess; false where nothing was measured (kAllocator, or a
  // first measurement while a graph may be capturing). After a measurement, reserved may stand
  // above the budget: the caller gives back.
  bool measure(DeviceState& d);

 private:
  LimitScope scope_;
  std::atomic<OutsideSource> source_{OutsideSource::kNone};
};

}  // namespace gpumem
