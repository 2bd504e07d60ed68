// The limit and what it bounds: setting it, and setting its scope (the allocator's reserved bytes,
// or the whole process; core/process_scope.h measures what is outside). The cap itself,
// reserve-ask-roll back, is core/cap.h.
#include "core/device_core.h"

namespace gpumem {

// Note [reserved above a lowered limit]
//   Lowering the limit releases what is cached, but live blocks keep their memory, so reserved can
//   stand above the new limit. From then on every growth is refused (the cap measures against
//   reserved), and every free that makes memory releasable gives cached memory back, oldest first,
//   until reserved is under the limit again: the cap is restored by the frees themselves, without
//   waiting for an empty_cache(). While a pool is the allocation target (a graph may be
//   capturing) nothing is released, as in empty_cache(); the first free after it ends resumes.
void DeviceCore::set_limit(std::size_t limit) {
  d_.accounts.set_limit(limit);
  if (scope_.scope() == LimitScope::kProcess && d_.accounts.cap().reserved() > 0) measure_outside();
  if (d_.accounts.cap().reserved() > d_.accounts.cap().budget()) {
    if (!d_.capturing()) process_events();
    release_.oldest_until(d_.accounts.cap().budget());
  }
  if (release_.threshold() > 0.0) release_.apply_threshold();
  debug_check();
}

// Setting the process scope measures at once only where the device holds memory (and so has a
// context): otherwise the first growth does, so that naming a scope makes no CUDA context on a
// device the program never uses.
void DeviceCore::set_scope(LimitScope scope) {
  const LimitScope before = scope_.scope();
  if (scope == before) return;
  scope_.set(d_, scope);
  if (scope == LimitScope::kProcess && d_.accounts.cap().reserved() > 0) {
    if (!d_.capturing()) process_events();
    try {
      measure_outside();
    } catch (...) {
      scope_.set(d_, before);
      throw;
    }
  }
  if (release_.threshold() > 0.0) release_.apply_threshold();
  debug_check();
}

}  // namespace gpumem
