// Giving cached memory back: core/release.h.
#include "core/release.h"

#include <string>
#include <vector>

#include "core/errors.h"
#include "core/limit_spec.h"

namespace gpumem {

void check_release_threshold(double share) {
  if (!(share >= 0.0 && share <= 1.0)) {
    throw LimitSpecError({"release threshold", std::to_string(share), "it is not a share of the limit",
                          "a share of the limit in (0, 1], or 0 to turn it off", ""});
  }
}

CacheRelease::CacheRelease(DeviceState& d, Sources& sources, double threshold)
    : d_(d), sources_(sources), threshold_(threshold) {
  check_release_threshold(threshold);
}

bool CacheRelease::oldest_until(std::size_t reserved_target) {
  const std::size_t reserved = d_.accounts.cap().reserved();
  return reserved > reserved_target && bytes(reserved - reserved_target, ReleaseOrder::kOldest) > 0;
}

// Asks both sources, plain first, for `need` bytes in `order`; the bytes that went (counted once
// if any).
std::size_t CacheRelease::bytes(std::size_t need, ReleaseOrder order) {
  std::size_t freed = sources_.plain.release(need, order);
  if (freed < need) freed += sources_.growable.release(need - freed, order);
  if (freed > 0) d_.accounts.released_cache();
  return freed;
}

bool CacheRelease::all_unused() {
  const bool released = oldest_until(0);
  sources_.growable.drop_empty();
  return released;
}

bool CacheRelease::for_request(const Request& r) {
  const std::size_t bytes_added = sources_.serving(*r.pool).growth_for(r.size);
  // Reserved may stand above a lowered limit: the shortfall counts from there, not from zero headroom.
  const std::size_t after = d_.accounts.cap().reserved() + bytes_added, limit = d_.accounts.cap().budget();
  const std::size_t need = r.device_refused ? bytes_added : (after > limit ? after - limit : 0);
  return need > 0 && bytes(need, ReleaseOrder::kForRequest) > 0;
}

void CacheRelease::over_limit() {
  if (!d_.capturing()) oldest_until(d_.accounts.cap().budget());
}

void CacheRelease::after_free(const Block* merged) {
  // Usually neither holds, and the free ends here.
  const bool over = d_.accounts.cap().reserved() > d_.accounts.cap().budget() && !d_.capturing();
  if (!over && threshold_ == 0.0) return;
  // Something became releasable: a whole plain segment, or a free page of a growable one.
  if (!sources_.of(*merged->segment).frees_memory(*merged)) return;
  if (over) over_limit();
  if (threshold_ > 0.0) apply_threshold();
}

void CacheRelease::set_threshold(double share) {
  check_release_threshold(share);
  threshold_ = share;
  if (share > 0.0) apply_threshold();
}

void CacheRelease::apply_threshold() {
  // The share is of the limit; under a limit on the whole process, what is outside counts too.
  const auto share = static_cast<std::size_t>(threshold_ * static_cast<double>(d_.accounts.cap().limit()));
  oldest_until(share > d_.accounts.cap().outside() ? share - d_.accounts.cap().outside() : 0);
}

bool CacheRelease::pool_cache(const Pool& pool) {
  std::vector<Segment*> unused;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->pool == &pool && segment->is_unused()) unused.push_back(segment.get());
  }
  for (Segment* s : unused) sources_.plain.release_segment(s);
  return !unused.empty();
}

bool CacheRelease::unheld_pools_cache() {
  bool released = false;
  d_.pools.for_each([&](const Pool& pool) {
    if (pool.use_count() == 0 && pool_cache(pool)) released = true;
  });
  return released;
}

}  // namespace gpumem
