// Private pools: CUDA graphs, torch.cuda.MemPool, torch.compile's cudagraph trees.
//
// A private pool caches its own segments, apart from the default pool's. Its lifecycle follows
// PyTorch's native allocator, so the same Python code reserves the same memory:
//   - holders: create_pool adds one (MemPool's constructor, and each begin of an allocation to the
//     pool in the adapter), release_pool drops one (a graph's reset, MemPool's destructor, the end
//     of use_mem_pool). A pool nobody holds is *freeable*: its unused segments go back at
//     empty_cache (all freeable pools, or the one named) and whenever memory is needed (the
//     release paths of malloc, a lowered limit, the release threshold). A held pool's cache is
//     never released: its graphs replay into it. release_pool itself releases nothing, as native;
//     MemPool's destructor follows it with emptyCache(its id).
//   - a freeable pool with no segment left that is no allocation target is erased.
//   - options: a source of its own (MemPool(allocator); core/segment_source.h), set at creation;
//     no_split (its blocks are never split); use_on_oom (while held, its cached free blocks may
//     serve a default-pool request that could not get new memory: reuse only, its source is never
//     asked for more on another pool's behalf).
#include <algorithm>
#include <string>

#include "core/device_allocator.h"

namespace gpumem {

namespace {

std::string name_of(PoolId id) { return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")"; }

}  // namespace

void DeviceAllocator::create_pool(PoolId id, std::shared_ptr<SegmentSource> source) {
  const WholeDevice whole(*this);
  auto& pool = private_pools_[id];
  if (pool && source) {
    // Its segments came from elsewhere: a second source would leave them with no single owner.
    throw std::invalid_argument("gpumem: pool " + name_of(id) +
                                " exists already, so it cannot take an allocator of its own; a pool's allocator "
                                "is given only when the pool is created (torch.cuda.MemPool(allocator) makes a new pool)");
  }
  if (!pool) {
    pool = std::make_unique<Pool>();
    pool->id = id;
    pool->source = std::move(source);
  }
  ++pool->use_count;
}

void DeviceAllocator::begin_allocate_to_pool(PoolId id, StreamFilter filter) {
  const WholeDevice whole(*this);
  auto it = private_pools_.find(id);
  if (it == private_pools_.end()) {
    throw std::logic_error("gpumem: allocation to pool " + name_of(id) + " begun before the pool was created");
  }
  d_.targets.push_back({it->second.get(), std::move(filter)});
}

void DeviceAllocator::end_allocate_to_pool(PoolId id) {
  const WholeDevice whole(*this);
  for (auto it = d_.targets.rbegin(); it != d_.targets.rend(); ++it) {
    if (it->pool->id == id) {
      d_.targets.erase(std::next(it).base());
      break;
    }
  }
  release_free_pools();
  if (d_.capturing()) return;
  for (const Deferred& d : deferred_) {
    d.block->pending_events = 0;
    insert_events(d.block);
  }
  deferred_.clear();
  give_back_over_limit();
}

void DeviceAllocator::release_pool(PoolId id) {
  const WholeDevice whole(*this);
  auto it = private_pools_.find(id);
  if (it == private_pools_.end() || it->second->use_count == 0) return;
  if (--it->second->use_count > 0) return;
  give_back_over_limit();
  release_free_pools();
  debug_check();
}

int DeviceAllocator::pool_use_count(PoolId id) const {
  const WholeDevice whole(*this);
  auto it = private_pools_.find(id);
  return it == private_pools_.end() ? 0 : it->second->use_count;
}

Pool& DeviceAllocator::existing_pool(PoolId id) const {
  auto it = private_pools_.find(id);
  if (it == private_pools_.end()) {
    throw std::invalid_argument("gpumem: pool " + name_of(id) + " does not exist on device " + std::to_string(d_.device) +
                                "; create it first (torch.cuda.MemPool does)");
  }
  return *it->second;
}

void DeviceAllocator::set_no_split(PoolId id) {
  const WholeDevice whole(*this);
  existing_pool(id).no_split = true;
}

void DeviceAllocator::set_use_on_oom(PoolId id, bool on) {
  const WholeDevice whole(*this);
  existing_pool(id).use_on_oom = on;
}

// A cached free block of at least `size` on `stream` from a held use_on_oom pool, or nullptr.
Block* DeviceAllocator::try_use_on_oom_pools(const Request& r) {
  for (auto& [id, pool] : private_pools_) {
    if (!pool->use_on_oom || pool->use_count == 0) continue;
    if (Block* block = try_cached(*pool, r)) return block;
  }
  return nullptr;
}

// ---- releasing private pools' caches ----

bool DeviceAllocator::is_target(const Pool* pool) const {
  return std::any_of(d_.targets.begin(), d_.targets.end(), [pool](const DeviceState::PoolTarget& t) { return t.pool == pool; });
}

// Gives back the pool's unused segments, to its source; true if any.
bool DeviceAllocator::release_pool_cache(const Pool& pool) {
  std::vector<Segment*> unused;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->pool == &pool && segment->is_unused()) unused.push_back(segment.get());
  }
  for (Segment* s : unused) plain_.release_segment(s);
  return !unused.empty();
}

bool DeviceAllocator::release_unheld_pools_cache() {
  bool released = false;
  for (const auto& [id, pool] : private_pools_) {
    if (pool->use_count == 0 && release_pool_cache(*pool)) released = true;
  }
  return released;
}

// empty_cache of one pool: only if nobody holds it. Blocks still waiting for other streams are
// waited for first (outside a capture), so that what the program freed goes back; the wait is
// counted even when nothing waits, as native counts it (Note [what num_sync_all_streams counts]).
void DeviceAllocator::empty_pool_cache(PoolId id) {
  auto it = private_pools_.find(id);
  if (it == private_pools_.end() || it->second->use_count > 0) return;
  const Pool* pool = it->second.get();
  if (!d_.capturing()) synchronize_and_process_events();
  if (release_pool_cache(*pool)) ++d_.stats.num_cache_releases;
}

// Drops private pools nobody holds, has memory in, or allocates to.
void DeviceAllocator::release_free_pools() {
  for (auto it = private_pools_.begin(); it != private_pools_.end();) {
    const Pool* pool = it->second.get();
    const bool dead = pool->use_count == 0 && pool->segments == 0 && !is_target(pool);
    it = dead ? private_pools_.erase(it) : std::next(it);
  }
}

}  // namespace gpumem
