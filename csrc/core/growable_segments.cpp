// Growable segments: memory that grows and shrinks in place, page by page.
//
// Design note. Under a cap, plain segments fail jobs that would fit: once memory is cut into
// segments, a request larger than every free hole needs a new segment, and the cap may have no
// room for one even though the holes together would hold it. Releasing a cached segment only helps
// when a whole segment is free. A growable segment removes both limits. It is an address range as
// large as the device (Backend::reserve_address), per stream and size class of the default pool,
// backed by physical pages only where blocks need them (Backend::map), so
//   - a request that no cached block holds maps just the pages it lacks at the end of a free block,
//     growing that block in place instead of adding a segment;
//   - free memory anywhere in a segment, not only whole segments, can go back to the device:
//     the whole chunks (physical allocations of one or more pages, Note [physical chunks]) inside
//     a free block are unmapped (Backend::unmap), and live neighbours stay.
// Reserved bytes, and the cap, count mapped bytes.
//
// In a growable segment, blocks tile the whole address range as in a plain one. A block is either
// mapped (allocated, pending or cached free memory) or unmapped: a free stretch with no memory
// behind it, kept in the pool's unmapped set. Unmapped blocks start and end on chunk boundaries
// (they are made by unmapping whole chunks), so every chunk is either wholly under an unmapped
// block or mapped; a chunk may hold parts of several mapped blocks. Free neighbours merge only when
// both are mapped or both unmapped.
//
// Regions' pools (core/pause.cpp) use growable segments too, whatever the default, so that they can
// be paused. Other private pools (CUDA graphs, MemPools) keep plain segments: their checkpointing
// and replay rely on segments that never change (docs/design.md, "Private pools", says how recent
// PyTorch differs).
// Unmapping needs the device synchronized, so nothing is unmapped while a pool target is active (a
// graph may be capturing).
#include "core/growable_segments.h"

#include <algorithm>
#include <array>
#include <cstdint>

#include "core/errors.h"
#include "core/largest_first.h"
#include "core/split_merge.h"

namespace gpumem {

namespace {

bool larger(const Block* a, const Block* b) { return a->size > b->size; }

}  // namespace

// A block of at least `size` bytes made by mapping chunks, or nullptr if the cap or the device has
// no room. Mapped in the chunks the request's size calls for (Note [physical chunks]), else, where
// the cap or the device has no room for whole ones, page by page. Where no address range can be
// had, a plain segment instead.
Block* GrowableSegments::grow(Request& r) {
  const std::size_t chunk = chunk_for(r.small, round_up(r.size, page_size_));
  bool no_range = false;
  Block* block = grow_in_chunks(r, chunk, no_range);
  if (!block && !no_range && chunk > page_size_) block = grow_in_chunks(r, page_size_, no_range);
  if (!block && no_range && !r.pool->region()) return plain_.grow(r);  // a region's must keep its addresses
  return block;
}

// grow() in the segments of `chunk`; nullptr with `no_range` set where a new segment was needed
// and the backend had no address range.
Block* GrowableSegments::grow_in_chunks(Request& r, std::size_t chunk, bool& no_range) {
  Growth growth = choose_unmapped(r, chunk);
  if (recycle_before_high_mark(growth, r.stream, round_up(r.size, chunk))) growth = choose_unmapped(r, chunk);
  Block* unmapped = growth.block;
  const bool fresh = unmapped == nullptr;
  if (fresh) unmapped = reserve_range(r, chunk);
  if (!unmapped) {
    no_range = true;
    return nullptr;
  }
  Segment* segment = unmapped->segment;
  Block* block = map_front(r, unmapped);
  if (!block && fresh) release_range(segment);
  return block;
}

// Design note. Left alone, a growable segment grows whenever the free blocks do not fit a request,
// so reserved climbs above what was ever allocated by the holes the job's changing shapes leave.
// Before new pages would take reserved past the most it ever held, the free pages that can cover
// them are unmapped and their memory is mapped where the request needs it: reserved then follows
// the job's allocated peak, not the holes. Only the request's stream's free pages are taken, so
// what must be waited for is that stream's queued work, not the device's: other streams (a data
// loader's, a collective's) run on. That wait and the remapping are paid only while reserved is at
// its high mark, which a job with a fixed working set (a training loop) reaches in its first
// steps; once the cache holds that working set it stops happening.
//
// A job whose shapes never settle (a server allocating random sizes from many requests) would pay
// it for ever: every few hundred calls its holes no longer fit a request, and pages move (an unmap
// and a map per 2 MiB, tens of microseconds each) where PyTorch's allocator would have cached one
// more segment once. So moving pages buys room: once the pages moved since the last grant add up
// to the high mark itself (the job has moved a whole cache's worth), the mark may be passed by an
// allowance, an eighth of the mark the first time and twice the last grant each time after, which
// growths past the mark use up. A training loop that moves less than its cache keeps reserved at
// its allocated peak; a job that keeps moving pages pays at most one cache's worth of moves per
// grant, and the grants double, so after a few its cache holds its working set, as native's does.
// None of this passes the cap: a growth within the allowance still asks it.
bool GrowableSegments::recycle_before_high_mark(const Growth& growth, StreamId stream, std::size_t fresh) {
  const std::size_t pages = growth.block ? growth.pages : fresh;
  const std::size_t reserved = d_.accounts.cap().reserved();
  if (reserved + pages <= d_.accounts.reserved_high()) return false;
  const std::size_t past = reserved + pages - d_.accounts.reserved_high();
  if (past <= allowance_) {
    allowance_ -= past;
    return false;
  }
  // The free blocks the growth would join stay: unmapping them would only add to the pages needed.
  const Block* u = growth.block;
  const Block* before = u && u->prev && u->prev->is_cached() ? u->prev : nullptr;
  const Block* after = u && u->next && u->next->is_cached() ? u->next : nullptr;
  const std::size_t moved = unmap_stream_pages(stream, past, {before, after});
  remapped_ += moved;
  moved_ += moved;
  if (remapped_ >= d_.accounts.reserved_high()) {
    next_grant_ = next_grant_ == 0 ? d_.accounts.reserved_high() / 8 : 2 * next_grant_;
    allowance_ += next_grant_;
    remapped_ = 0;
  }
  return moved > 0;
}

// The unmapped block of a segment of `chunk` that, mapped from its start and joined with its free
// mapped neighbours, holds `size` bytes with the fewest new chunks (the lowest address among
// equals), and those chunks' bytes; no block if none. Among the stream's kHolesLooked largest
// unmapped blocks only: a stream
// whose free pages were unmapped between many live blocks has as many holes, and looking at each
// one at every growth would make a ramp through them quadratic. Past that many, a growth may map
// a few more pages than the fewest possible (the largest holes, which most often hold the request
// alone, are the ones looked at); the high mark still bounds what it reserves.
GrowableSegments::Growth GrowableSegments::choose_unmapped(const Request& r, std::size_t chunk) const {
  const std::size_t size = r.size;
  const Block* best = nullptr;
  std::size_t best_need = 0;
  const FreeBins* holes = r.pool->unmapped_for(r.small).existing_bins(r.stream);
  if (!holes) return {nullptr, 0};
  largest_first::Position at = largest_first::kStart;
  for (int looked = 0; looked < kHolesLooked; ++looked) {
    const Block* u = largest_first::after(*holes, at);
    if (!u) break;
    at = {u->size, u->addr};
    ++blocks_visited_;
    if (u->segment->chunk != chunk) continue;
    const std::size_t before = cached_before(u);
    const std::size_t after = u->next && u->next->is_cached() ? u->next->size : 0;
    if (size <= before || before + u->size + after < size) continue;
    const std::size_t need = size - before <= u->size ? round_up(size - before, chunk) : u->size;
    if (!best || need < best_need || (need == best_need && u->addr < best->addr)) {
      best = u;
      best_need = need;
    }
  }
  return {const_cast<Block*>(best), best_need};
}

// A new growable segment of `chunk` for the pool and stream: an unmapped block spanning the
// device's size (or the request, if larger); nullptr when the backend has no address range.
Block* GrowableSegments::reserve_range(const Request& r, std::size_t chunk) {
  Pool& pool = *r.pool;
  const bool small = r.small;
  const std::size_t bytes = round_up(std::max(d_.device_total(), r.size), chunk);
  void* ptr = d_.backend.reserve_address(d_.device, bytes);
  if (!ptr) return nullptr;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  if (d_.segments.overlaps(addr, bytes)) d_.segments.throw_overlap("reserve_address", addr, bytes);
  Segment* segment = d_.add_segment(pool, small, r.stream, addr, bytes, chunk);
  pool.unmapped_for(small).insert(segment->head);
  d_.accounts.open_segment(small);
  return segment->head;
}

// Maps the chunks at the start of `unmapped` that, with its free mapped neighbours, make a block of
// `size` bytes (the rest of the last one stays cached), and returns that merged block (in no set);
// nullptr if the cap or the device refuses them.
Block* GrowableSegments::map_front(Request& r, Block* unmapped) {
  return map_bytes(r, unmapped, std::min(round_up(r.size - cached_before(unmapped), unmapped->segment->chunk), unmapped->size));
}

// The free mapped block before `unmapped`'s start, which a growth there joins: its bytes, or 0.
std::size_t GrowableSegments::cached_before(const Block* unmapped) {
  return unmapped->prev && unmapped->prev->is_cached() ? unmapped->prev->size : 0;
}

// Maps the first `bytes` (whole chunks) of `unmapped` and returns them merged with their free
// mapped neighbours, in no set; nullptr, with nothing changed, if the cap or the device refuses.
Block* GrowableSegments::map_bytes(Request& r, Block* unmapped, std::size_t bytes) {
  Segment& segment = *unmapped->segment;
  const bool small = segment.small;
  if (!d_.accounts.map_pages(r.device_refused, small, bytes, [&] { return map_chunks(segment, unmapped->addr, bytes); })) {
    return nullptr;
  }
  FreeBlocks& unmapped_set = segment.pool->unmapped_for(small);
  unmapped_set.erase(unmapped);
  if (bytes < unmapped->size) unmapped_set.insert(split_block(unmapped, bytes, d_.arena_for(segment.stream)));
  unmapped->set_mapped(true);
  return merge_free_neighbours(unmapped, segment.pool->blocks_for(small), d_.arena_for(segment.stream)).block;
}

// Design note [mapping while the others release]. A request the device refuses while other
// processes sharing the GPU cache memory asks them for what the device lacks (sharing/member.cpp);
// each gives back its largest cached blocks, chunk by chunk. Mapping the request's own memory
// (a physical allocation, a map and an access grant per chunk) costs about as much as that release,
// so waiting for it to end and then mapping would take the sum of the two. Instead, while the others
// release, the request maps the chunks the device holds now of the very growth grow() would make:
// the same segment and hole (choose_unmapped, or a new range), from its front, as cached memory that
// grow() later joins. What the device had free from the start is mapped at once, and the rest as it
// comes back, so the request ends about when the others' release does. If the device still lacks
// memory after the wait, the release before the request's error (DeviceCore::malloc_on_device)
// gives back what was mapped ahead, as it gives back any cache.
std::size_t GrowableSegments::map_ahead(Request& r, std::size_t device_free) {
  const std::size_t chunk = chunk_for(r.small, round_up(r.size, page_size_));
  Block* unmapped = choose_unmapped(r, chunk).block;
  const bool fresh = unmapped == nullptr;
  if (fresh && device_free < chunk) return most_mapped_for(r);
  if (fresh) unmapped = reserve_range(r, chunk);
  if (!unmapped) return most_mapped_for(r);
  Segment& segment = *unmapped->segment;
  const std::size_t before = cached_before(unmapped);
  if (before >= r.size) return 0;
  const std::size_t need = std::min(round_up(r.size - before, chunk), unmapped->size);
  const std::size_t bytes = std::min(need, device_free / chunk * chunk);
  Block* mapped = bytes > 0 ? map_bytes(r, unmapped, bytes) : nullptr;
  if (!mapped) {
    if (fresh) release_range(&segment);
    return need;
  }
  segment.pool->blocks_for(segment.small).insert(mapped);
  return need - bytes;
}

// Unmaps the whole chunks inside `block` (cached, in a growable segment), or the last of them that
// hold `most` bytes; the parts of chunks at its ends, and the chunks kept, stay mapped as cached
// blocks of their own. Returns the bytes unmapped. The device must be synchronized.
std::size_t GrowableSegments::unmap_block(Block* block, std::size_t most) {
  Segment& segment = *block->segment;
  const bool small = segment.small;
  auto [lo, hi] = chunks_inside(block);
  if (hi <= lo) return 0;
  if (most < hi - lo) lo = hi - round_up(most, segment.chunk);
  d_.backend.unmap(d_.device, reinterpret_cast<void*>(lo), hi - lo);
  segment.remove_chunks(lo, hi);
  d_.accounts.unmap_pages(small, hi - lo);

  FreeBlocks& cached = segment.pool->blocks_for(small);
  cached.erase(block);
  Block* front = nullptr;
  Block* back = nullptr;
  Block* middle = block;
  if (lo > block->addr) {
    front = block;
    middle = split_block(block, lo - block->addr, d_.arena_for(segment.stream));
  }
  if (hi < middle->addr + middle->size) back = split_block(middle, hi - middle->addr, d_.arena_for(segment.stream));
  for (Block* remnant : {front, back}) {
    if (remnant) cached.insert(remnant);
  }
  middle->set_mapped(false);
  FreeBlocks& unmapped_set = segment.pool->unmapped_for(small);
  unmapped_set.insert(merge_free_neighbours(middle, unmapped_set, d_.arena_for(segment.stream)).block);
  return hi - lo;
}

// [lo, hi): the whole chunks inside `block`, a mapped block of a growable segment (empty when
// lo >= hi). They are contiguous: chunks tile the mapped stretches.
std::pair<std::uintptr_t, std::uintptr_t> GrowableSegments::chunks_inside(const Block* block) const {
  if (block->size < page_size_) return {0, 0};  // no chunk is smaller than a page
  const auto& chunks = block->segment->chunks;
  const std::uintptr_t end = block->addr + block->size;
  const auto first = chunks.lower_bound(block->addr);
  if (first == chunks.end() || *first >= end) return {0, 0};
  const std::uintptr_t last = *std::prev(chunks.lower_bound(end));  // the last chunk starting inside the block
  const std::uintptr_t last_end = last + block->segment->chunk;
  return {*first, last_end <= end ? last_end : last};
}

bool GrowableSegments::holds_free_page(const Block* block) const {
  if (!block->segment->growable || !block->is_cached()) return false;
  const auto [lo, hi] = chunks_inside(block);
  return hi > lo;
}

// Design note [physical chunks]. Each Backend::map call is one physical allocation, and memory
// goes back only as whole allocations (a CUDA mapping is unmapped whole). Page-sized allocations
// let any free page go back, but cost a driver call each way per page: on an H200, mapping 60 GiB
// as 2 MiB pages took 2.1 s and unmapping it 1.3 s, against 0.05 s each in 64 MiB pieces. So a
// request of the large pool is mapped in chunks of a power-of-two number of pages, the largest not
// above 1/kChunksPerGrowth of it and kMaxChunk: under 256 pages a page, a 1 GiB request 8 MiB, a
// 60 GiB one 256 MiB (240 calls). The small pool maps pages. 1/128, not coarser: a growth maps
// whole chunks, and the rest of the last one (up to 1/128 of the growth) is cached; at 1/32, a GPT
// training step's reserved memory rose from 1.0018 to 1.0067 times its allocated peak on an H100
// (benchmarks/bench_training.py --mode step), above native's expandable segments (1.0043).
//
// A chunk is also what another process imports, one driver call each, when a tensor on it is sent
// (torch/ipc.cpp), and torch's own allocator opens only chunks of one size. So each segment maps
// chunks of one size (Segment::chunk), a request grows the segment of its chunk, and a growth maps
// whole chunks, the rest of the last one cached: no block lies on chunks of two sizes. Where the
// cap or the device refuses whole chunks, the request grows the segment of pages (grow()); what
// the cap then counts beyond the live blocks to the page is the free parts of chunks they share,
// which cannot go back while they live. AllocatorConfig::large_chunk raises the large
// pool's least chunk (GPUMEM_CHUNK): a model's weights grown in 2 MiB pages took a receiver 2.3
// times native's time to open (native maps its large pool in 20 MiB pages), in 16 MiB chunks less
// than native's; the price is a coarser cap, since a chunk part of which is in use stays mapped
// (cached), so a live block holds at most two chunks partly. The chunk table is the segment's
// (Segment::chunks); Segment::mapped() is its sum.
std::size_t GrowableSegments::chunk_for(bool small, std::size_t bytes) const {
  std::size_t chunk = page_size_;
  if (small) return chunk;
  while (chunk <= kMaxChunk / 2 && (chunk < large_chunk_ || 2 * chunk * kChunksPerGrowth <= bytes)) chunk *= 2;
  return chunk;
}

// Maps [addr, addr + bytes), whole chunks of `segment`, and files them; false, with nothing of it
// mapped, when the device has no memory for them.
bool GrowableSegments::map_chunks(Segment& segment, std::uintptr_t addr, std::size_t bytes) {
  if (!d_.backend.map(d_.device, reinterpret_cast<void*>(addr), bytes, segment.chunk)) return false;
  segment.add_chunks(addr, bytes);
  return true;
}

// Cached blocks of growable segments that hold at least one whole chunk, oldest segment first and
// in address order within one.
std::vector<Block*> GrowableSegments::unmappable_blocks() const {
  std::vector<const Segment*> growable;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->growable && d_.releasable_pool(*segment->pool)) growable.push_back(segment.get());
  }
  std::sort(growable.begin(), growable.end(), [](const Segment* a, const Segment* b) { return a->serial < b->serial; });
  std::vector<Block*> blocks;
  for (const Segment* s : growable) {
    for (Block* b = s->head; b; b = b->next) {
      ++blocks_visited_;
      if (holds_free_page(b)) blocks.push_back(b);
    }
  }
  return blocks;
}

// Unmaps free pages until `bytes` are unmapped or none are left: for a request, from the largest
// free blocks first (fewest calls, and small cached blocks are the likeliest to be reused); else
// the oldest first. Returns the bytes unmapped.
std::size_t GrowableSegments::release(std::size_t bytes, ReleaseOrder order) {
  if (d_.capturing() || bytes == 0) return 0;
  std::vector<Block*> blocks = unmappable_blocks();
  if (blocks.empty()) return 0;
  if (order == ReleaseOrder::kForRequest) std::stable_sort(blocks.begin(), blocks.end(), larger);
  d_.backend.synchronize(d_.device);  // not counted: Note [what num_sync_all_streams counts] (core/release.h)
  return unmap_until(blocks, bytes, order == ReleaseOrder::kForRequest);
}

// Design note [what a growth past the high mark looks at]. A growth past the high mark unmaps
// free pages of its stream, largest free blocks first, until it has the pages it needs. Those
// pages are inside the stream's cached blocks, and the free set already files every cached block
// by stream and (size, address), kept in step on every path that frees, splits or merges (the
// lanes' cached paths included). So the walk reads the blocks from there, largest first
// (core/largest_first.h), and stops once it has the bytes or reaches a block smaller than a page,
// which holds no whole page: no second index to keep in step with the first, nothing added to
// the cached path, and no look at live blocks. Each step is O(log n) in the cached blocks; the
// blocks looked at are those unmapped (each then leaves the cached set), the two kept, and the
// cached blocks of at least a page that hold no whole page (under two pages, off the page
// boundaries) or lie in plain segments of the default pool. A job that ramps up without freeing
// looks at none. Among blocks of one size the lowest address goes first. Growable segments are
// the default pool's only (serves()), so its free set is the one to read.
//
// The same over the free pages of one stream's segments, largest first, never those of `keep`. A
// block of a stream's segment was last used on that stream (uses on others held it pending until
// their work was done), so waiting for that stream suffices.
std::size_t GrowableSegments::unmap_stream_pages(StreamId stream, std::size_t bytes, std::array<const Block*, 2> keep) {
  if (d_.capturing() || bytes == 0) return 0;
  Block* block = next_unmappable(stream, largest_first::kStart, keep);
  if (!block) return 0;
  d_.backend.synchronize_stream(d_.device, stream);
  std::size_t unmapped = 0;
  while (block) {
    const largest_first::Position at{block->size, block->addr};  // what stays of it is smaller than a page: after `at`
    unmapped += unmap_block(block);
    block = unmapped < bytes ? next_unmappable(stream, at, keep) : nullptr;
  }
  return unmapped;
}

// The cached block of `stream` after `at`, largest first, that holds a whole page of a growable
// segment and is not kept; nullptr if none.
Block* GrowableSegments::next_unmappable(StreamId stream, largest_first::Position at, std::array<const Block*, 2> keep) const {
  for (Block* b = next_cached(stream, at); b && b->size >= page_size_; b = next_cached(stream, at)) {
    ++blocks_visited_;
    if (b != keep[0] && b != keep[1] && holds_free_page(b)) return b;
    at = {b->size, b->addr};
  }
  return nullptr;
}

// The cached block of the default pool on `stream` after `at`, largest first, of either size class.
Block* GrowableSegments::next_cached(StreamId stream, largest_first::Position at) const {
  Block* next = nullptr;
  for (const bool small : {false, true}) {
    const FreeBins* bins = d_.default_pool.blocks_for(small).existing_bins(stream);
    Block* b = bins ? largest_first::after(*bins, at) : nullptr;
    if (b && (!next || largest_first::before(b, next))) next = b;
  }
  return next;
}

// With `exact`, the last block gives only the chunks still needed: a request (of this process or
// of another, core/release.h) gets what it lacks and one chunk more at most, not a whole cache.
std::size_t GrowableSegments::unmap_until(const std::vector<Block*>& blocks, std::size_t bytes, bool exact) {
  std::size_t unmapped = 0;
  for (Block* b : blocks) {
    if (unmapped >= bytes) break;
    unmapped += unmap_block(b, exact ? bytes - unmapped : SIZE_MAX);
  }
  return unmapped;
}

// Gives back the address ranges of growable segments with no page mapped.
void GrowableSegments::drop_empty() {
  std::vector<Segment*> empty;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->growable && segment->mapped() == 0 && d_.releasable_pool(*segment->pool)) empty.push_back(segment.get());
  }
  for (Segment* s : empty) release_range(s);
}

// Drops a growable segment with no page mapped (one unmapped block).
void GrowableSegments::release_range(Segment* segment) {
  Block* head = segment->head;
  segment->pool->unmapped_for(segment->small).erase(head);
  d_.backend.release_address(d_.device, head->ptr(), segment->size);
  d_.accounts.close_segment(segment->small);
  d_.erase_segment(segment);
}

// The destructor's: every mapped stretch unmapped (none while paused), then the address range.
void GrowableSegments::drop(const Segment& segment) noexcept {
  if (!segment.paused.empty()) {
    quietly([&] { d_.backend.release_address(d_.device, segment.head->ptr(), segment.size); });
    return;
  }
  for_each_stretch(segment, [&](const Block* first, const Block*, std::uintptr_t stop) {
    quietly([&] { d_.backend.unmap(d_.device, first->ptr(), stop - first->addr); });
  });
  quietly([&] { d_.backend.release_address(d_.device, segment.head->ptr(), segment.size); });
}

// ---- pausing a region (core/pause.cpp) ----

std::size_t GrowableSegments::unmap_cached_of(const Pool& pool) {
  std::vector<Block*> blocks;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->pool != &pool || !segment->growable) continue;
    for (Block* b = segment->head; b; b = b->next) {
      if (holds_free_page(b)) blocks.push_back(b);
    }
  }
  return unmap_until(blocks, SIZE_MAX, false);
}

std::size_t GrowableSegments::pause(Segment& segment) {
  const std::size_t bytes = segment.mapped();
  for_each_run(segment.chunks, segment.chunk, [&](std::uintptr_t lo, std::uintptr_t hi) {
    d_.backend.unmap(d_.device, reinterpret_cast<void*>(lo), hi - lo);
  });
  segment.paused.swap(segment.chunks);
  segment.chunks.clear();
  d_.accounts.unmap_pages(segment.small, bytes);
  return bytes;
}

bool GrowableSegments::resume(Segment& segment, bool& device_refused) {
  const std::size_t bytes = segment.paused.size() * segment.chunk;
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> runs;
  for_each_run(segment.paused, segment.chunk, [&](std::uintptr_t lo, std::uintptr_t hi) { runs.emplace_back(lo, hi); });
  // Each run mapped, or none: a run the device refuses, or that throws, unmaps those before it.
  const auto map_all = [&] {
    std::size_t done = 0;
    const auto undo = [&] {
      for (std::size_t i = 0; i < done; ++i) {
        quietly([&] { d_.backend.unmap(d_.device, reinterpret_cast<void*>(runs[i].first), runs[i].second - runs[i].first); });
      }
    };
    try {
      for (; done < runs.size(); ++done) {
        const auto [lo, hi] = runs[done];
        if (!d_.backend.map(d_.device, reinterpret_cast<void*>(lo), hi - lo, segment.chunk)) {
          undo();
          return false;
        }
      }
    } catch (...) {
      undo();
      throw;
    }
    return true;
  };
  if (!d_.accounts.map_pages(device_refused, segment.small, bytes, map_all)) return false;
  segment.chunks.swap(segment.paused);
  segment.paused.clear();
  return true;
}

}  // namespace gpumem
