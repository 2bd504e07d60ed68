// The limit and what it bounds: setting it (by bytes or by spec), its scope (the allocator's
// reserved bytes, or the whole process), measuring the memory outside the allocator, and the
// pressure watches. The cap itself, reserve-ask-roll back, is core/cap.h.
#include <algorithm>
#include <string>

#include "core/device_allocator.h"
#include "core/limit_spec.h"

namespace gpumem {

void DeviceAllocator::set_limit(std::optional<std::size_t> limit) {
  if (limit && *limit > d_.device_total) {
    throw LimitSpecError("gpumem: limit of " + format_bytes(*limit) + " is above device " + std::to_string(d_.device) +
                         "'s total of " + format_bytes(d_.device_total) + ". " + kLimitForms);
  }
  const WholeDevice whole(*this);
  set_limit_locked(limit.value_or(d_.device_total));
}

void DeviceAllocator::set_limit(std::string_view spec) {
  const std::optional<std::size_t> limit = parse_limit(spec, d_.device_total);
  const WholeDevice whole(*this);
  set_limit_locked(limit.value_or(d_.device_total));
}

// Note [reserved above a lowered limit]
//   Lowering the limit releases what is cached, but live blocks keep their memory, so reserved can
//   stand above the new limit. From then on every growth is refused (the cap measures against
//   reserved), and every free that makes memory releasable gives cached memory back, oldest first,
//   until reserved is under the limit again: the cap is restored by the frees themselves, without
//   waiting for an empty_cache(). While a pool is the allocation target (a graph may be
//   capturing) nothing is released, as in empty_cache(); the first free after it ends resumes.
void DeviceAllocator::set_limit_locked(std::size_t limit) {
  d_.cap.set_limit(limit);
  if (scope_ == LimitScope::kProcess && d_.cap.reserved() > 0) measure_outside_locked();
  if (d_.cap.reserved() > d_.cap.budget()) {
    if (!d_.capturing()) process_events();
    release_oldest_until(d_.cap.budget());
  }
  if (release_threshold_ > 0.0) apply_release_threshold();
  debug_check();
}

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
//   lowered limit]).
void DeviceAllocator::measure_outside_locked() {
  if (scope_ != LimitScope::kProcess) return;
  const bool measured = outside_source_.load(std::memory_order_relaxed) != OutsideSource::kNone;
  // The first measurement may make the device's context: not while a graph may be capturing.
  if (!measured && d_.capturing()) return;
  const std::size_t held = d_.cap.reserved();
  std::optional<std::size_t> used = d_.backend.process_used(d_.device);
  // Less than the allocator holds cannot be this process's figure (a pid that names another
  // process, in a container's own pid namespace): as if there were none.
  // A figure that went away leaves the last one in place; one that is not ours falls back.
  const bool not_ours = used && *used < held;
  if (not_ours) used.reset();
  if (used) {
    d_.cap.set_outside(*used - held);
    outside_source_.store(OutsideSource::kProcessAccounting, std::memory_order_relaxed);
  } else if (!measured || (not_ours && outside_source_.load(std::memory_order_relaxed) ==
                                           OutsideSource::kProcessAccounting)) {
    const MemInfo mem = d_.backend.mem_info(d_.device);
    const std::size_t device_used = mem.total - std::min(mem.free, mem.total);
    d_.cap.set_outside(device_used > held ? device_used - held : 0);
    outside_source_.store(OutsideSource::kDeviceAtFirst, std::memory_order_relaxed);
  }
  give_back_over_limit();  // what is outside may have grown past what reserved leaves it
}

// Setting the process scope measures at once only where the device holds memory (and so has a
// context): otherwise the first growth does, so that naming a scope makes no CUDA context on a
// device the program never uses.
void DeviceAllocator::set_scope(LimitScope scope) {
  const WholeDevice whole(*this);
  const LimitScope before = scope_;
  if (scope == before) return;
  scope_ = scope;
  if (scope == LimitScope::kAllocator) {
    d_.cap.set_outside(0);
    outside_source_.store(OutsideSource::kNone, std::memory_order_relaxed);
  } else if (d_.cap.reserved() > 0) {
    if (!d_.capturing()) process_events();
    try {
      measure_outside_locked();
    } catch (...) {
      scope_ = before;
      throw;
    }
  }
  if (release_threshold_ > 0.0) apply_release_threshold();
  debug_check();
}

LimitScope DeviceAllocator::scope() const {
  const WholeDevice whole(*this);
  return scope_;
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

void DeviceAllocator::set_share(ShareHooks* share) {
  const WholeDevice whole(*this);
  d_.share = share;
  if (!share) d_.cap.set_ceiling(SIZE_MAX);
}

void DeviceAllocator::set_shared_ceiling(std::size_t bytes) {
  const WholeDevice whole(*this);
  d_.cap.set_ceiling(bytes);
  give_back_over_limit();  // a neighbour's floor came back: cache first (Note [reserved above a lowered limit])
}

void DeviceAllocator::watch_pressure(int slot, double share) {
  const WholeDevice whole(*this);
  d_.cap.watch_pressure(slot, share);
}

}  // namespace gpumem
