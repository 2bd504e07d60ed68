// Plain segments (core/plain_segments.h): getting one from the pool's source, and giving unused ones back.
#include "core/plain_segments.h"

#include "core/errors.h"
#include "core/release_policy.h"
#include "core/sizing.h"

namespace gpumem {

Block* PlainSegments::grow(Request& r) {
  const std::size_t normal = segment_size(r.size);
  if (Block* block = reserve(r, normal)) return block;
  const std::size_t tight = tight_segment_size(r.size);
  return tight == normal ? nullptr : reserve(r, tight);
}

// Releasing for a request frees room for the smallest segment that holds it.
std::size_t PlainSegments::growth_for(std::size_t size) const { return tight_segment_size(size); }

// The cap first, then the pool's source (the backend, or a MemPool's allocator); the cap is given
// back if the source refuses or throws (core/accounts.h).
Block* PlainSegments::reserve(Request& r, std::size_t bytes) {
  void* ptr = d_.accounts.map_segment(r.device_refused, r.small, bytes, [&] {
    void* got = d_.source_of(*r.pool).reserve(bytes);
    // Memory that is not the allocator's cannot be given back either: the cap forgets it as refused.
    const auto addr = reinterpret_cast<std::uintptr_t>(got);
    if (got && d_.segments.overlaps(addr, bytes)) d_.segments.throw_overlap("reserve", addr, bytes);
    return got;
  });
  if (!ptr) return nullptr;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  return d_.add_segment(*r.pool, r.small, r.stream, addr, bytes, /*chunk=*/0)->head;
}

std::vector<Segment*> PlainSegments::unused() const {
  std::vector<Segment*> found;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->is_unused() && d_.releasable_pool(*segment->pool)) found.push_back(segment.get());
  }
  return found;
}

void PlainSegments::release_segment(Segment* segment) {
  Block* head = segment->head;
  const bool defer = deferred_ && segment->source == &d_.backend_source;
  if (defer) {
    deferred_->push_back({segment->source, head->ptr(), segment->size});  // first: it may throw
    d_.departing.add(segment->size);
  } else {
    segment->source->release(head->ptr(), segment->size);
  }
  segment->pool->blocks_for(segment->small).erase(head);
  if (defer) {
    d_.accounts.segment_departing(segment->small, segment->size);
  } else {
    d_.accounts.unmap_segment(segment->small, segment->size);
  }
  d_.erase_segment(segment);
}

// Oldest first until `bytes` went back; for a request, the segments the release policy chooses.
std::size_t PlainSegments::release(std::size_t bytes, ReleaseOrder order) {
  if (bytes == 0) return 0;
  std::vector<Segment*> candidates = unused();
  if (order == ReleaseOrder::kOldest) {
    sort_oldest_first(candidates);
  } else {
    candidates = choose_for_bytes(std::move(candidates), bytes);
  }
  std::size_t freed = 0;
  for (Segment* s : candidates) {
    if (order == ReleaseOrder::kOldest && freed >= bytes) break;
    freed += s->size;
    release_segment(s);
  }
  return freed;
}

void PlainSegments::drop(const Segment& segment) noexcept {
  quietly([&] { segment.source->release(segment.head->ptr(), segment.size); });
}

}  // namespace gpumem
