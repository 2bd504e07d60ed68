// Giving cached memory back to where it came from: which segments may go, and when they go.
//   - over the limit (a lowered limit, or memory outside the allocator that grew): the frees
//     themselves give back, oldest first (Note [reserved above a lowered limit], core/limits.cpp);
//   - for a request the cap or the device refused: what it lacks, chosen by the release policy
//     (core/release_policy.cpp), then free pages of growable segments;
//   - above the release threshold: oldest first, down to the threshold's share of the limit;
//   - at empty_cache: everything cached that nobody holds.
// What goes, and how, is each source's (core/plain_segments.cpp, core/growable_segments.cpp). Every
// release that gives anything back counts one num_cache_releases.
//
// Note [what num_sync_all_streams counts]
// As native counts it (its synchronize_and_free_events): one per pass that waits for every
// stream's pending frees before everything cached goes, whether or not anything was pending and
// whatever the segments are: each empty_cache of the default pool outside a capture, each
// empty_cache of an unheld pool's id, and the release of everything before an OOM. A program
// that checks "one empty_cache, one sync" (PyTorch's test_memory_stats does) sees the same figure
// under gpumem. One difference: a request whose live blocks and size exceed the limit is refused
// at once (no release could serve it), so nothing is released or counted; native counts its
// release of everything there too. The device synchronizations that unmapping growable pages
// needs (on any release: empty_cache, a lowered limit, the release threshold, a request) are not
// counted, as native does not count those of its expandable segments.
#pragma once

#include <cstddef>

#include "core/device_state.h"
#include "core/sources.h"

namespace gpumem {

// Throws LimitSpecError unless `share` is a release threshold: in (0, 1], or 0 (off).
void check_release_threshold(double share);

class CacheRelease {
 public:
  CacheRelease(DeviceState& d, Sources& sources, double threshold);
  CacheRelease(const CacheRelease&) = delete;
  CacheRelease& operator=(const CacheRelease&) = delete;

  // Oldest first until reserved is at most `reserved_target`: whole plain segments, then the free
  // pages of growable ones; true if anything went.
  bool oldest_until(std::size_t reserved_target);
  // Everything cached that nobody holds, and the empty address ranges of growable segments.
  bool all_unused();
  // Room for `r`: under the cap, what the cap lacks for the memory the request would add; when the
  // device itself refused, as much as that memory (its free memory is not the cap's to know).
  bool for_request(const Request& r);
  // For another process sharing the GPU (sharing/member.cpp): `need` bytes, largest cached first,
  // no more whole chunks (growable) than that needs; returns the bytes released.
  std::size_t for_others(std::size_t need) { return bytes(need, ReleaseOrder::kForRequest); }
  // Down to the budget, outside a capture (Note [reserved above a lowered limit]).
  void over_limit();
  // After a free under the whole device: what the limit or the release threshold asks, if the free
  // made memory releasable.
  void after_free(const Block* merged);

  // The release threshold: a share of the limit in (0, 1], 0 off. Setting it releases down to it.
  void set_threshold(double share);
  double threshold() const { return threshold_; }
  void apply_threshold();

  // A private pool's unused segments, to its source; true if any.
  bool pool_cache(const Pool& pool);
  // Those of every private pool nobody holds.
  bool unheld_pools_cache();

 private:
  std::size_t bytes(std::size_t need, ReleaseOrder order);

  DeviceState& d_;
  Sources& sources_;
  double threshold_;
};

}  // namespace gpumem
