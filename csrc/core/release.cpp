// Giving cached memory back to where it came from: which segments may go, and when they go.
//   - over the limit (a lowered limit, or memory outside the allocator that grew): the frees
//     themselves give back, oldest first (Note [reserved above a lowered limit], core/limits.cpp);
//   - for a request the cap or the device refused: what it lacks, chosen by the release policy
//     (core/release_policy.cpp), then free pages of growable segments;
//   - above the release threshold: oldest first, down to the threshold's share of the limit;
//   - at empty_cache: everything cached that nobody holds.
// The growable segments' pages are unmapped by core/growable.cpp.
#include <cstdint>

#include "core/device_allocator.h"
#include "core/release_policy.h"
#include "core/sizing.h"

namespace gpumem {

bool DeviceAllocator::releasable_pool(const Pool& pool) const {
  return &pool == &default_pool_ || pool.use_count == 0;
}

bool DeviceAllocator::releasable(const Segment& segment) const {
  return segment.is_unused() && releasable_pool(*segment.pool);
}

std::vector<Segment*> DeviceAllocator::unused_segments() const {
  std::vector<Segment*> unused;
  for (const auto& [addr, segment] : segments_) {
    if (releasable(*segment)) unused.push_back(segment.get());
  }
  return unused;
}

// The source first: if it throws, the segment is still cached and everything is as before.
void DeviceAllocator::release_segment(Segment* segment) {
  Block* head = segment->head;
  segment->source->release(head->ptr(), segment->size);
  segment->pool->blocks_for(segment->small).erase(head);
  cap_.unreserve(segment->size);
  stats_.unreserve(segment->small, segment->size, 1);
  ++stats_.num_device_free;
  --segment->pool->segments;
  arena_.recycle(head);
  segments_.erase(segment->addr);
}

// Gives cached memory back, oldest first, until reserved is at most `reserved_target`: whole plain
// segments, then the free pages of growable ones.
bool DeviceAllocator::release_oldest_until(std::size_t reserved_target) {
  std::vector<Segment*> unused = unused_segments();
  sort_oldest_first(unused);
  bool released = false;
  for (Segment* s : unused) {
    if (cap_.reserved() <= reserved_target) break;
    release_segment(s);
    released = true;
  }
  if (cap_.reserved() > reserved_target && unmap_free_pages(cap_.reserved() - reserved_target, false) > 0) {
    released = true;
  }
  if (released) ++stats_.num_cache_releases;
  return released;
}

bool DeviceAllocator::release_all_unused() {
  const bool released = release_oldest_until(0);
  drop_unmapped_segments();
  return released;
}

// Frees room for a request of `size` in `pool`: under the cap, what the cap lacks for the memory the
// request would add; when the device itself refused, as much as that memory (its free memory is
// not the cap's to know). Plain segments first, by the release policy; then free pages.
bool DeviceAllocator::release_for(const Request& r) {
  const Pool& pool = *r.pool;
  const std::size_t size = r.size;
  const std::size_t bytes = uses_growable(pool) ? round_up(size, page_size_) : tight_segment_size(size);
  // Reserved may stand above a lowered limit: the shortfall counts from there, not from zero headroom.
  const std::size_t after = cap_.reserved() + bytes, limit = cap_.budget();
  const std::size_t need = r.device_refused ? bytes : (after > limit ? after - limit : 0);
  if (need == 0) return false;
  std::size_t freed = 0;
  for (Segment* s : choose_for_bytes(unused_segments(), need)) {
    freed += s->size;
    release_segment(s);
  }
  if (freed < need) freed += unmap_free_pages(need - freed, true);
  if (freed == 0) return false;
  ++stats_.num_cache_releases;
  return true;
}

void DeviceAllocator::apply_release_threshold() {
  // The share is of the limit; under a limit on the whole process, what is outside counts too.
  const auto share = static_cast<std::size_t>(release_threshold_ * static_cast<double>(cap_.limit()));
  const std::size_t target = share > cap_.outside() ? share - cap_.outside() : 0;
  if (cap_.reserved() > target) release_oldest_until(target);
}

void DeviceAllocator::empty_cache(PoolId id) {
  std::lock_guard<Lock> lock(mutex_);
  if (!id.is_default()) {
    empty_pool_cache(id);
  } else if (pool_targets_.empty()) {
    synchronize_and_process_events();
    release_all_unused();
  } else {
    // A graph may be capturing: the default pool keeps its memory (freeing it would break the
    // capture), as native does; pools nobody holds are not being captured into.
    if (release_unheld_pools_cache()) ++stats_.num_cache_releases;
  }
  release_free_pools();
  debug_check();
}

// See Note [reserved above a lowered limit].
void DeviceAllocator::give_back_over_limit() {
  if (cap_.reserved() > cap_.budget() && pool_targets_.empty()) release_oldest_until(cap_.budget());
}

void DeviceAllocator::set_release_threshold(double share) {
  check_release_threshold(share);
  std::lock_guard<Lock> lock(mutex_);
  release_threshold_ = share;
  if (share > 0.0) apply_release_threshold();
}

double DeviceAllocator::release_threshold() const {
  std::lock_guard<Lock> lock(mutex_);
  return release_threshold_;
}

}  // namespace gpumem
