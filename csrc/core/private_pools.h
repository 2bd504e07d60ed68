// Private pools (CUDA graphs, torch.cuda.MemPool, torch.compile's cudagraph trees): the pools by
// id, their holders and options, and the pool targets (while a pool is the allocation target for
// the streams a filter accepts, requests on those streams come from it). Releasing a pool's cache
// is core/release.h's; what a pool is, core/pool.h.
//
// Invariant: a pool is erased only when nobody holds it, it has no segment and no target names it.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "core/pool.h"

namespace gpumem {

// Chooses the pool for a request while graphs capture or MemPools are in use.
using StreamFilter = std::function<bool(StreamId)>;

class PrivatePools {
 public:
  explicit PrivatePools(int device) : device_(device) {}
  PrivatePools(const PrivatePools&) = delete;
  PrivatePools& operator=(const PrivatePools&) = delete;

  // Creates the pool with one holder, its segments from `source` (nullptr: the backend), or adds a
  // holder to an existing pool; giving a source for an existing pool throws std::invalid_argument.
  void create(PoolId id, std::shared_ptr<SegmentSource> source);
  // Drops a holder; true if that left the pool unheld (its cache may go).
  bool drop_holder(PoolId id);
  int use_count(PoolId id) const;
  // The pool `id`; throws std::invalid_argument if there is none.
  Pool& existing(PoolId id) const;
  // The pool `id` if it exists and nobody holds it, else nullptr.
  Pool* unheld(PoolId id) const;

  // Targets, most recent first in effect. Beginning for a pool never created throws std::logic_error.
  void begin_target(PoolId id, StreamFilter filter);
  void end_target(PoolId id);
  // A target is active: a graph may be capturing, so nothing waits on events, synchronizes or unmaps.
  bool capturing() const { return !targets_.empty(); }
  // The pool the most recent target accepting `stream` names, else `otherwise`.
  Pool& target_for(StreamId stream, Pool& otherwise) const;

  // A cached free block of at least `size` on `stream` from a held use_on_oom pool, or nullptr.
  Block* take_for_oom(bool small, StreamId stream, std::size_t size);
  // Erases the pools nobody holds, has memory in, or allocates to.
  void erase_dead();

  template <class F>
  void for_each(F f) const {
    for (const auto& [id, pool] : pools_) f(*pool);
  }

 private:
  struct Target {
    Pool* pool;
    StreamFilter filter;
  };
  bool is_target(const Pool* pool) const;

  const int device_;
  std::map<PoolId, std::unique_ptr<Pool>> pools_;
  std::vector<Target> targets_;  // most recent last
};

}  // namespace gpumem
