// Private pools: CUDA graphs, torch.cuda.MemPool, torch.compile's cudagraph trees.
//
// A private pool caches its own segments, apart from the default pool's. Its lifecycle follows
// PyTorch's native allocator, so the same Python code reserves the same memory:
//   - holders: create adds one (MemPool's constructor, and each begin of an allocation to the
//     pool in the adapter), drop_holder drops one (a graph's reset, MemPool's destructor, the end
//     of use_mem_pool). A pool nobody holds is *freeable*: its unused segments go back at
//     empty_cache (all freeable pools, or the one named) and whenever memory is needed (the
//     release paths of malloc, a lowered limit, the release threshold). A held pool's cache is
//     never released: its graphs replay into it. Dropping a holder itself releases nothing, as
//     native; MemPool's destructor follows it with emptyCache(its id).
//   - a freeable pool with no segment left that is no allocation target is erased.
//   - options: a source of its own (MemPool(allocator); core/segment_source.h), set at creation;
//     no_split (its blocks are never split); use_on_oom (while held, its cached free blocks may
//     serve a default-pool request that could not get new memory: reuse only, its source is never
//     asked for more on another pool's behalf).
#include "core/private_pools.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace gpumem {

namespace {

std::string name_of(PoolId id) { return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")"; }

}  // namespace

void PrivatePools::create(PoolId id, std::shared_ptr<SegmentSource> source) {
  auto& pool = pools_[id];
  if (pool && source) {
    // Its segments came from elsewhere: a second source would leave them with no single owner.
    throw std::invalid_argument("gpumem: pool " + name_of(id) +
                                " exists already, so it cannot take an allocator of its own; a pool's allocator "
                                "is given only when the pool is created (torch.cuda.MemPool(allocator) makes a new pool)");
  }
  if (!pool) pool = std::make_unique<Pool>(id, std::move(source));
  pool->add_holder();
}

bool PrivatePools::drop_holder(PoolId id) {
  auto it = pools_.find(id);
  return it != pools_.end() && it->second->drop_holder();
}

int PrivatePools::use_count(PoolId id) const {
  auto it = pools_.find(id);
  return it == pools_.end() ? 0 : it->second->use_count();
}

Pool& PrivatePools::existing(PoolId id) const {
  auto it = pools_.find(id);
  if (it == pools_.end()) {
    throw std::invalid_argument("gpumem: pool " + name_of(id) + " does not exist on device " + std::to_string(device_) +
                                "; create it first (torch.cuda.MemPool does)");
  }
  return *it->second;
}

Pool* PrivatePools::unheld(PoolId id) const {
  auto it = pools_.find(id);
  return it == pools_.end() || it->second->use_count() > 0 ? nullptr : it->second.get();
}

void PrivatePools::begin_target(PoolId id, StreamFilter filter) {
  auto it = pools_.find(id);
  if (it == pools_.end()) {
    throw std::logic_error("gpumem: allocation to pool " + name_of(id) + " begun before the pool was created");
  }
  targets_.push_back({it->second.get(), std::move(filter)});
}

void PrivatePools::end_target(PoolId id) {
  for (auto it = targets_.rbegin(); it != targets_.rend(); ++it) {
    if (it->pool->id() == id) {
      targets_.erase(std::next(it).base());
      return;
    }
  }
}

Pool& PrivatePools::target_for(StreamId stream, Pool& otherwise) const {
  for (auto it = targets_.rbegin(); it != targets_.rend(); ++it) {
    if (it->filter(stream)) return *it->pool;
  }
  return otherwise;
}

Block* PrivatePools::take_for_oom(bool small, StreamId stream, std::size_t size) {
  for (auto& [id, pool] : pools_) {
    if (!pool->use_on_oom() || pool->use_count() == 0) continue;
    if (Block* block = pool->blocks_for(small).take_best_fit(stream, size)) return block;
  }
  return nullptr;
}

bool PrivatePools::is_target(const Pool* pool) const {
  return std::any_of(targets_.begin(), targets_.end(), [pool](const Target& t) { return t.pool == pool; });
}

void PrivatePools::erase_dead() {
  for (auto it = pools_.begin(); it != pools_.end();) {
    const Pool* pool = it->second.get();
    const bool dead = pool->use_count() == 0 && pool->segments() == 0 && !is_target(pool);
    it = dead ? pools_.erase(it) : std::next(it);
  }
}

}  // namespace gpumem
