// The invariant checker: walks every segment and the uncached memory, and recomputes the statistics
// (see block.h). The cap is checked against them: reserved = segments' mapped bytes (whatever their
// source) + uncached bytes, all of which the statistics count (Note [caching off in the statistics]).
#include <map>
#include <sstream>
#include <stdexcept>

#include "core/device_core.h"

namespace gpumem {

namespace {

struct Recount {
  DeviceStats stats;
  std::map<const Pool*, std::size_t> free_blocks;      // cached blocks per pool, both size classes
  std::map<const Pool*, std::size_t> unmapped_blocks;  // per pool, both size classes
  std::map<const Pool*, int> segments;                 // per pool
};

[[noreturn]] void broken(int device, const std::string& what, std::uintptr_t addr) {
  std::ostringstream msg;
  msg << "gpumem invariant broken on device " << device << ": " << what << " (at 0x" << std::hex << addr << ")";
  throw std::logic_error(msg.str());
}

// Inactive split blocks are counted in plain segments only (StatLedger::split_change).
void count_block(Recount& r, const Block& b, bool small, bool growable) {
  if (!b.mapped) return;  // no memory: in no statistic
  const auto bytes = static_cast<std::int64_t>(b.size);
  if (b.allocated) {
    increase_stat(r.stats.allocation, small, 1);
    increase_stat(r.stats.allocated_bytes, small, bytes);
  }
  if (!b.is_free()) {
    increase_stat(r.stats.requested_bytes, small, static_cast<std::int64_t>(b.requested));
    increase_stat(r.stats.active, small, 1);
    increase_stat(r.stats.active_bytes, small, bytes);
  } else if (b.is_split() && !growable) {
    increase_stat(r.stats.inactive_split, small, 1);
    increase_stat(r.stats.inactive_split_bytes, small, bytes);
  }
}

// An unmapped block: free, whole pages of a growable segment, in its pool's unmapped set only.
void check_unmapped(int device, const Segment& s, const Block& b, std::size_t page) {
  if (!s.growable) broken(device, "unmapped block in a plain segment", b.addr);
  if (!b.is_free()) broken(device, "unmapped block is in use", b.addr);
  if ((b.addr - s.addr) % page != 0 || b.size % page != 0) broken(device, "unmapped block is not whole pages", b.addr);
  if (!s.pool->unmapped_for(s.small).contains(&b)) broken(device, "unmapped block missing from its pool", b.addr);
  if (s.pool->blocks_for(s.small).contains(&b)) broken(device, "unmapped block in a free set", b.addr);
}

void check_block(int device, const Segment& s, const Block* b) {
  if (b->segment != &s) broken(device, "block points to another segment", b->addr);
  if (b->stream != s.stream) broken(device, "block stream differs from its segment's", b->addr);
  if (b->next && b->next->prev != b) broken(device, "block list links disagree", b->addr);
  if (b->next && b->addr + b->size != b->next->addr) broken(device, "blocks are not contiguous", b->addr);
  if (b->next && b->is_free() && b->next->is_free() && b->mapped == b->next->mapped) {
    broken(device, "two free neighbours were not merged", b->addr);
  }
  if (b->size == 0 || b->size % 512 != 0) broken(device, "block size is not a positive multiple of 512", b->addr);
  if (s.pool->blocks_for(!s.small).contains(b) || s.pool->unmapped_for(!s.small).contains(b)) {
    broken(device, "free block in the wrong size class", b->addr);
  }
}

// A segment goes back where it came from: its pool's own source, else the backend's.
void check_source(int device, const Segment& s, const SegmentSource* backend_source) {
  const SegmentSource* expected = s.pool->source() ? s.pool->source() : backend_source;
  if (s.source != expected) broken(device, "segment's source is not its pool's", s.addr);
  if (s.growable && s.pool->source()) broken(device, "growable segment in a pool with a source of its own", s.addr);
  if (s.pool->no_split() && s.head->next) broken(device, "segment of a no_split pool holds more than one block", s.addr);
}

// A growable segment's chunks tile its mapped stretches: disjoint, all of the segment's chunk size
// (whole pages, and the segment whole chunks), inside the segment, and none reaching into an
// unmapped block; a paused segment's paused chunks the same (their sum, Segment::laid(), is checked against the blocks in check_segment).
void check_chunks(int device, const Segment& s, std::size_t page) {
  if (!s.growable) {
    if (!s.chunks.empty() || s.chunk != 0) broken(device, "plain segment with chunks", s.addr);
    return;
  }
  if (s.chunk == 0 || s.chunk % page != 0 || s.size % s.chunk != 0) broken(device, "growable segment is not whole chunks", s.addr);
  const std::set<std::uintptr_t>& chunks = s.paused.empty() ? s.chunks : s.paused;  // a paused segment's lie paused
  std::uintptr_t end = s.addr;
  for (const std::uintptr_t addr : chunks) {
    if (addr < end || (addr - s.addr) % s.chunk != 0) broken(device, "chunks overlap or are not the segment's chunks", addr);
    if (addr + s.chunk > s.addr + s.size) broken(device, "chunk reaches past its segment", addr);
    end = addr + s.chunk;
  }
  for (const Block* b = s.head; b; b = b->next) {
    if (b->mapped) continue;
    auto it = chunks.lower_bound(b->addr);
    const bool inside = it != chunks.end() && *it < b->addr + b->size;
    const bool before = it != chunks.begin() && *std::prev(it) + s.chunk > b->addr;
    if (inside || before) broken(device, "a chunk reaches into an unmapped block", b->addr);
  }
}

void check_segment(int device, const Segment& s, std::size_t page, Recount& r) {
  if (!s.head || s.head->prev || s.head->addr != s.addr) broken(device, "segment head is not its first block", s.addr);
  ++r.segments[s.pool];
  if (s.growable && (page == 0 || s.addr % page != 0 || s.size % page != 0)) {
    broken(device, "growable segment is not whole pages", s.addr);
  }
  increase_stat(r.stats.segment, s.small, 1);
  increase_stat(r.stats.reserved_bytes, s.small, static_cast<std::int64_t>(s.mapped()));
  std::size_t total = 0, unmapped = 0;
  for (const Block* b = s.head; b; b = b->next) {
    check_block(device, s, b);
    total += b->size;
    if (!b->mapped) {
      check_unmapped(device, s, *b, page);
      ++r.unmapped_blocks[s.pool];
      unmapped += b->size;
      continue;
    }
    const bool in_own = s.pool->blocks_for(s.small).contains(b);
    if (in_own != b->is_free()) broken(device, b->is_free() ? "free block missing from its pool" : "used block in a free set", b->addr);
    if (s.pool->unmapped_for(s.small).contains(b)) broken(device, "mapped block in an unmapped set", b->addr);
    if (b->is_free()) ++r.free_blocks[s.pool];
    count_block(r, *b, s.small, s.growable);
  }
  if (total != s.size) broken(device, "block sizes do not sum to the segment size", s.addr);
  if (s.laid() != s.size - unmapped) broken(device, "mapped bytes differ from the segment less its unmapped blocks", s.addr);
  if (!s.paused.empty() && (!s.chunks.empty() || !s.pool->paused())) broken(device, "a segment is partly paused, or paused in a pool that is not", s.addr);
  check_chunks(device, s, page);
}

void compare(int device, const char* name, const StatArray& kept, const StatArray& recounted) {
  for (int t = 0; t < kNumStatTypes; ++t) {
    if (kept[t].current != recounted[t].current) {
      std::ostringstream msg;
      msg << "statistic " << name << "." << kStatTypeNames[t] << ".current is " << kept[t].current
          << " but the segments hold " << recounted[t].current;
      broken(device, msg.str(), 0);
    }
  }
}

// Blocks have one home (core/lanes.h): each arena's Blocks are its spares and the blocks of the
// segments of the streams it serves, so a Block that went to another arena shows here.
void check_arenas(const DeviceState& d) {
  std::map<int, std::size_t> in_segments;  // by lane index, -1 the device's arena
  for (const auto& [addr, segment] : d.segments) {
    std::size_t& count = in_segments[d.lanes.lane_index_of(segment->stream)];
    for (const Block* b = segment->head; b; b = b->next) ++count;
  }
  d.lanes.for_each_arena([&](const BlockArena& arena, int index) {
    if (arena.made() != arena.spares() + in_segments[index]) {
      broken(d.device, "an arena's blocks are not its spares and its streams' blocks (a Block left its home)", 0);
    }
  });
}

}  // namespace

void check_device(const DeviceCore& core) {
  const DeviceState& d = core.d_;
  Recount r;
  for (const auto& [addr, segment] : d.segments) {
    if (addr != segment->addr) broken(d.device, "segment filed under the wrong address", addr);
    check_segment(d.device, *segment, core.sources_.growable.page_size(), r);
    check_source(d.device, *segment, &d.backend_source);
  }
  const auto check_pool = [&](const Pool& pool) {
    for (const bool small : {true, false}) {
      pool.blocks_for(small).check();
      pool.unmapped_for(small).check();
    }
    const std::size_t in_sets = pool.blocks_for(true).size() + pool.blocks_for(false).size();
    if (in_sets != r.free_blocks[&pool]) broken(d.device, "a free set holds blocks that are not free blocks of its segments", 0);
    if (pool.unmapped_for(true).size() + pool.unmapped_for(false).size() != r.unmapped_blocks[&pool]) {
      broken(d.device, "an unmapped set holds blocks that are not unmapped blocks of its segments", 0);
    }
    if (pool.segments() != r.segments[&pool]) broken(d.device, "a pool's segment count differs from its segments", 0);
  };
  check_pool(d.default_pool);
  d.pools.for_each(check_pool);
  core.uncached_.for_each([&](std::size_t bytes, std::size_t requested) {
    const auto held = static_cast<std::int64_t>(bytes);
    for (StatArray* stat : {&r.stats.segment, &r.stats.allocation, &r.stats.active}) increase_stat(*stat, false, 1);
    for (StatArray* stat : {&r.stats.reserved_bytes, &r.stats.allocated_bytes, &r.stats.active_bytes}) {
      increase_stat(*stat, false, held);
    }
    increase_stat(r.stats.requested_bytes, false, static_cast<std::int64_t>(requested));
  });
  const DeviceStats kept = d.accounts.ledger().snapshot();
#define GPUMEM_COMPARE(name, help) compare(d.device, #name, kept.name, r.stats.name);
  GPUMEM_STAT_ARRAYS(GPUMEM_COMPARE)
#undef GPUMEM_COMPARE
  if (d.accounts.cap().reserved() != static_cast<std::size_t>(d.accounts.ledger().reserved_bytes()) + d.departing.bytes()) {
    broken(d.device, "the cap's reserved bytes differ from the statistics and those departing", 0);
  }
  check_arenas(d);
  std::map<const Block*, int> events;
  core.events_.for_each_wait([&](const Block* block) { ++events[block]; });
  for (const auto& [block, count] : events) {
    if (block->pending_events != count) broken(d.device, "pending event count differs from the events queued", block->addr);
  }
}

// Under one lane only: other lanes run meanwhile, so this reads only what the lane owns (the blocks
// of its streams' default-pool segments, their bins, its arena) and what only the whole device
// changes (the segment table, the streams' bins tables). The statistics, shared, are checked under
// the whole device.
void check_lane(const DeviceCore& core, const Lane& lane) {
  const DeviceState& d = core.d_;
  std::size_t blocks = 0;
  for (const auto& [addr, segment] : d.segments) {
    const Segment& s = *segment;  // its stream and pool never change
    const LaneSlot* slot = d.lanes.slot_of(s.stream);
    if (!slot || slot->lane != &lane) continue;
    const FreeBins* bins = s.pool->blocks_for(s.small).existing_bins(s.stream);
    std::size_t total = 0;
    for (const Block* b = s.head; b; b = b->next) {
      ++blocks;
      total += b->size;
      if (b->segment != &s) broken(d.device, "block points to another segment", b->addr);
      if (b->next && (b->next->prev != b || b->addr + b->size != b->next->addr)) {
        broken(d.device, "a segment's blocks are not linked in address order", b->addr);
      }
      if (b->next && b->is_free() && b->next->is_free() && b->mapped == b->next->mapped) {
        broken(d.device, "two free neighbours were not merged", b->addr);
      }
      if (b->mapped && b->is_free() != (bins && FreeBlocks::contains_in(*bins, b))) {
        broken(d.device, b->is_free() ? "free block missing from its bins" : "used block in its bins", b->addr);
      }
    }
    if (total != s.size) broken(d.device, "block sizes do not sum to the segment size", s.addr);
  }
  if (lane.arena.made() != lane.arena.spares() + blocks) {
    broken(d.device, "a lane's arena's blocks are not its spares and its streams' blocks (a Block left its home)", 0);
  }
}

}  // namespace gpumem
