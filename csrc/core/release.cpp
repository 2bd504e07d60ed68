// Giving cached memory back to where it came from: which segments may go, and when they go.
//   - over the limit (a lowered limit, or memory outside the allocator that grew): the frees
//     themselves give back, oldest first (Note [reserved above a lowered limit], core/limits.cpp);
//   - for a request the cap or the device refused: what it lacks, chosen by the release policy
//     (core/release_policy.cpp), then free pages of growable segments;
//   - above the release threshold: oldest first, down to the threshold's share of the limit;
//   - at empty_cache: everything cached that nobody holds.
// What goes, and how, is each source's (core/plain_segments.cpp, core/growable_segments.cpp).
//
// Note [what num_sync_all_streams counts]
// As native counts it (its synchronize_and_free_events): one per pass that waits for every
// stream's pending frees before everything cached goes, whether or not anything was pending and
// whatever the segments are: each empty_cache of the default pool outside a capture, each
// empty_cache of an unheld pool's id, and the release of everything before an OOM. A program
// that checks "one empty_cache, one sync" (PyTorch's test_memory_stats does) sees the same figure
// under gpumem. One difference: a request whose live blocks and size exceed the limit is refused
// at once (no release could serve it), so nothing is released or counted; native counts its
// release of everything there too. The device synchronizations that unmapping growable pages needs (on any release:
// empty_cache, a lowered limit, the release threshold, a request) are not counted, as native does
// not count those of its expandable segments.
#include "core/device_allocator.h"

namespace gpumem {

// Gives cached memory back, oldest first, until reserved is at most `reserved_target`: whole plain
// segments, then the free pages of growable ones.
bool DeviceAllocator::release_oldest_until(std::size_t reserved_target) {
  const std::size_t reserved = d_.cap.reserved();
  return reserved > reserved_target && release_bytes(reserved - reserved_target, ReleaseOrder::kOldest);
}

// Asks both sources, plain first, for `need` bytes in `order`; true (and counted) if any went.
bool DeviceAllocator::release_bytes(std::size_t need, ReleaseOrder order) {
  std::size_t freed = plain_.release(need, order);
  if (freed < need) freed += growable_.release(need - freed, order);
  if (freed == 0) return false;
  ++d_.stats.num_cache_releases;
  return true;
}

bool DeviceAllocator::release_all_unused() {
  const bool released = release_oldest_until(0);
  growable_.drop_empty();
  return released;
}

// Frees room for a request: under the cap, what the cap lacks for the memory the request would
// add; when the device itself refused, as much as that memory (its free memory is not the cap's to
// know). Plain segments first, by the release policy; then free pages, largest first.
bool DeviceAllocator::release_for(const Request& r) {
  const std::size_t bytes = memory_for(*r.pool).growth_for(r.size);
  // Reserved may stand above a lowered limit: the shortfall counts from there, not from zero headroom.
  const std::size_t after = d_.cap.reserved() + bytes, limit = d_.cap.budget();
  const std::size_t need = r.device_refused ? bytes : (after > limit ? after - limit : 0);
  return need > 0 && release_bytes(need, ReleaseOrder::kForRequest);
}

void DeviceAllocator::apply_release_threshold() {
  // The share is of the limit; under a limit on the whole process, what is outside counts too.
  const auto share = static_cast<std::size_t>(release_threshold_ * static_cast<double>(d_.cap.limit()));
  release_oldest_until(share > d_.cap.outside() ? share - d_.cap.outside() : 0);
}

void DeviceAllocator::empty_cache(PoolId id) {
  const WholeDevice whole(*this);
  if (!id.is_default()) {
    empty_pool_cache(id);
  } else if (!d_.capturing()) {
    synchronize_and_process_events();
    release_all_unused();
  } else {
    // A graph may be capturing: the default pool keeps its memory (freeing it would break the
    // capture), as native does; pools nobody holds are not being captured into.
    if (release_unheld_pools_cache()) ++d_.stats.num_cache_releases;
  }
  release_free_pools();
  debug_check();
}

// See Note [reserved above a lowered limit].
void DeviceAllocator::give_back_over_limit() {
  if (!d_.capturing()) release_oldest_until(d_.cap.budget());
}

void DeviceAllocator::set_release_threshold(double share) {
  check_release_threshold(share);
  const WholeDevice whole(*this);
  release_threshold_ = share;
  if (share > 0.0) apply_release_threshold();
}

double DeviceAllocator::release_threshold() const {
  const WholeDevice whole(*this);
  return release_threshold_;
}

}  // namespace gpumem
