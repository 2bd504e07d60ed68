// Measuring the memory outside the allocator: core/process_scope.h.
#include "core/process_scope.h"

#include <algorithm>
#include <optional>

namespace gpumem {

// Note [a limit on the whole process]
//   Under LimitScope::kProcess the limit bounds what the driver counts for the process on the
//   device: the allocator's reserved bytes plus `outside`, everything else the process holds there
//   (the CUDA context, library workspaces, NCCL's buffers). Outside is measured, under the lock,
//   whenever memory may grow (a malloc the cache could not serve, an uncached request) and, once
//   the device holds memory, when the limit or the scope is set (before that, the first growth
//   measures: naming a scope makes no context); never for the first time while a graph may be
//   capturing:
//   - from the backend's per-process figure (NVML's accounting for this pid) where it has one:
//     outside = that figure - reserved, which stays exact as long as nothing else in the process
//     allocates between the measurement and the growth. A figure below reserved cannot be this
//     process's (a pid of another pid namespace) and counts as none;
//   - else once, at the first measurement, from the device's used memory (total - free) less
//     reserved. That counts other processes on the device then as this one's, and misses what
//     libraries allocate later: the figure is kept, and reported as such.
//   The cap then lets reserved grow only to the budget, limit - outside, so reserved + outside, what
//   the driver counts, stays within the limit when the allocator grows. Memory another library
//   takes after the allocator's last growth cannot be refused (it never asks the allocator); the
//   next measurement counts it, and if reserved then stands above the budget, cached memory is given
//   back at once and by the frees that follow, as after a lowered limit (Note [reserved above a
//   lowered limit], core/limits.cpp).
bool ProcessScope::measure(DeviceState& d) {
  if (scope_ != LimitScope::kProcess) return false;
  const bool measured = source() != OutsideSource::kNone;
  // The first measurement may make the device's context: not while a graph may be capturing.
  if (!measured && d.capturing()) return false;
  const std::size_t held = d.accounts.cap().reserved();
  std::optional<std::size_t> used = d.backend.process_used(d.device);
  // Less than the allocator holds cannot be this process's figure (a pid that names another
  // process, in a container's own pid namespace): as if there were none.
  // A figure that went away leaves the last one in place; one that is not ours falls back.
  const bool not_ours = used && *used < held;
  if (not_ours) used.reset();
  if (used) {
    d.accounts.set_outside(*used - held);
    source_.store(OutsideSource::kProcessAccounting, std::memory_order_relaxed);
  } else if (!measured || (not_ours && source() == OutsideSource::kProcessAccounting)) {
    const MemInfo mem = d.backend.mem_info(d.device);
    const std::size_t device_used = mem.total - std::min(mem.free, mem.total);
    d.accounts.set_outside(device_used > held ? device_used - held : 0);
    source_.store(OutsideSource::kDeviceAtFirst, std::memory_order_relaxed);
  }
  return true;
}

void ProcessScope::set(DeviceState& d, LimitScope scope) {
  scope_ = scope;
  if (scope != LimitScope::kAllocator) return;
  d.accounts.set_outside(0);
  source_.store(OutsideSource::kNone, std::memory_order_relaxed);
}

const char* limit_scope_name(LimitScope scope) {
  return scope == LimitScope::kProcess ? "process" : "allocator";
}

const char* outside_source_name(OutsideSource source) {
  switch (source) {
    case OutsideSource::kNone: return "none";
    case OutsideSource::kProcessAccounting: return "process accounting";
    case OutsideSource::kDeviceAtFirst: return "device at first use";
  }
  return "none";
}

}  // namespace gpumem
