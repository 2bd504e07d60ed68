// Growable segments (core/growable_segments.cpp) on the simulated device with virtual memory: pages are
// mapped as blocks need them and unmapped when free, the cap counts mapped bytes, and a request
// fits whenever the pages it needs fit under the limit, however the free memory is scattered.
#include <algorithm>
#include <random>
#include <vector>

#include "helpers.h"

using namespace gpumem_test;

namespace {

constexpr std::size_t kPage = kSimPage;

std::size_t snapshot_bytes(const std::vector<SegmentInfo>& segments) {
  std::size_t bytes = 0;
  for (const SegmentInfo& s : segments) bytes += s.size;
  return bytes;
}

}  // namespace

// ---- choosing growable segments ---------------------------------------------------------------

TEST_CASE("growable segments are used by default where the backend maps pages", "[growable]") {
  VmSim sim;
  REQUIRE(sim.alloc.settings().growable);
  REQUIRE(sim.alloc.page_size() == kPage);
  Block* a = sim.malloc(5 * MiB);
  REQUIRE(a->segment->growable);
  REQUIRE(sim.ledger().reserves == 0);
  REQUIRE(sim.ledger().maps == 1);
  REQUIRE(sim.alloc.reserved() == 6 * MiB);  // the pages that hold 5 MiB, no 20 MiB segment
  REQUIRE(sim.ledger().mapped == 6 * MiB);
}

TEST_CASE("a backend without virtual memory keeps plain segments although growable ones are asked for", "[growable]") {
  Sim sim;  // the simulated device without virtual memory
  REQUIRE_FALSE(sim.alloc.settings().growable);
  REQUIRE(sim.alloc.page_size() == 0);
  Block* a = sim.malloc(5 * MiB);
  REQUIRE_FALSE(a->segment->growable);
  REQUIRE(sim.ledger().reserves == 1);
}

TEST_CASE("with no address range to be had, new memory comes from a plain segment", "[growable]") {
  VmSim sim;
  sim.backend.refuse_addresses(true);
  Block* a = sim.malloc(5 * MiB);
  REQUIRE_FALSE(a->segment->growable);
  REQUIRE(sim.ledger().reserves == 1);
  REQUIRE(sim.ledger().address_ranges == 0);
}

TEST_CASE("turning growable segments off takes effect for new memory only", "[growable]") {
  VmSim sim;
  Block* a = sim.malloc(5 * MiB);
  sim.alloc.set_growable(false);
  REQUIRE_FALSE(sim.alloc.settings().growable);
  Block* b = sim.malloc(30 * MiB);
  REQUIRE(a->segment->growable);
  REQUIRE_FALSE(b->segment->growable);
  sim.free(a);
  Block* c = sim.malloc(5 * MiB);  // the cached growable block still serves
  REQUIRE(c->segment->growable);
  REQUIRE(sim.ledger().reserves == 1);
}

TEST_CASE("private pools keep plain segments while the default pool grows", "[growable][pools]") {
  VmSim sim;
  const PoolId pool{1, 0};
  sim.alloc.create_pool(pool);
  sim.alloc.begin_allocate_to_pool(pool, [](StreamId s) { return s == kStream1; });
  Block* in_pool = sim.malloc(5 * MiB, kStream1);
  Block* outside = sim.malloc(5 * MiB, kStream0);
  sim.alloc.end_allocate_to_pool(pool);
  REQUIRE_FALSE(in_pool->segment->growable);
  REQUIRE(outside->segment->growable);
}

// ---- growing --------------------------------------------------------------------------------

TEST_CASE("a request no cached block holds grows the free block at the end of the mapped pages", "[growable]") {
  VmSim sim;
  Block* a = sim.malloc(4 * MiB);
  Block* b = sim.malloc(4 * MiB);
  sim.free(b);  // 4 MiB cached at the end
  Block* c = sim.malloc(10 * MiB);
  REQUIRE(c->addr == a->addr + 4 * MiB);  // b's place, grown by the 6 MiB it lacked
  REQUIRE(sim.alloc.reserved() == 14 * MiB);
  REQUIRE(sim.ledger().maps == 3);
  REQUIRE(sim.alloc.snapshot().size() == 1);  // one mapped stretch
}

TEST_CASE("each stream grows its own segment", "[growable][streams]") {
  VmSim sim;
  Block* a = sim.malloc(4 * MiB, kStream0);
  Block* b = sim.malloc(4 * MiB, kStream1);
  REQUIRE(a->segment != b->segment);
  REQUIRE(sim.ledger().address_ranges == 2);
}

TEST_CASE("small and large requests grow separate segments", "[growable]") {
  VmSim sim;
  Block* small = sim.malloc(4 * KiB);
  Block* large = sim.malloc(4 * MiB);
  REQUIRE(small->segment != large->segment);
  REQUIRE(small->segment->small);
  REQUIRE(sim.alloc.reserved() == kPage + 4 * MiB);
}

// ---- the high mark ----------------------------------------------------------------------------

TEST_CASE("new pages reuse free pages rather than take reserved past its high mark", "[growable][high-mark]") {
  VmSim sim;
  Block* a = sim.malloc(8 * MiB);
  Block* b = sim.malloc(4 * MiB);
  Block* c = sim.malloc(8 * MiB);
  REQUIRE(sim.alloc.reserved() == 20 * MiB);
  sim.free(a);
  sim.free(c);
  Block* d = sim.malloc(14 * MiB);  // no free block holds it; mapping 6 more MiB would reach 26 MiB
  REQUIRE(d->size >= 14 * MiB);
  REQUIRE(sim.alloc.reserved() <= 20 * MiB);
  REQUIRE(sim.ledger().peak == 20 * MiB);
  REQUIRE(b->allocated);
}

TEST_CASE("reusing free pages waits for the request's stream only, and takes only its pages", "[growable][high-mark][streams]") {
  VmSim sim;
  Block* other = sim.malloc(8 * MiB, kStream1);
  Block* a = sim.malloc(8 * MiB);
  Block* b = sim.malloc(4 * MiB);
  const std::uintptr_t other_addr = other->addr, a_addr = a->addr;
  sim.free(other);  // free pages on another stream: not this request's to take
  sim.free(a);
  const SimBackend::Ledger before = sim.ledger();
  sim.malloc(12 * MiB);
  REQUIRE(sim.ledger().stream_syncs == before.stream_syncs + 1);
  REQUIRE(sim.ledger().syncs == before.syncs);  // the device as a whole was not waited for
  REQUIRE(sim.mapped(other_addr));
  REQUIRE_FALSE(sim.mapped(a_addr));
  REQUIRE(sim.alloc.reserved() == 8 * MiB + 4 * MiB + 12 * MiB);
  (void)b;
}

TEST_CASE("a request past the high mark takes the free pages there are and maps only the rest", "[growable][high-mark]") {
  VmSim sim;
  Block* a = sim.malloc(8 * MiB);
  Block* b = sim.malloc(4 * MiB);
  Block* c = sim.malloc(4 * MiB);
  const std::uintptr_t hole = a->addr;
  sim.free(a);  // an 8 MiB hole; nothing free at the end
  sim.malloc(12 * MiB);
  REQUIRE(sim.alloc.reserved() == 20 * MiB);  // 16 + 12 - the 8 MiB unmapped
  REQUIRE(sim.ledger().peak == 20 * MiB);
  REQUIRE_FALSE(sim.mapped(hole));
  REQUIRE(b->allocated);
  REQUIRE(c->allocated);
}

TEST_CASE("the free block a growth extends is not unmapped to make room for it", "[growable][high-mark]") {
  VmSim sim;
  sim.free(sim.malloc(4 * MiB));
  sim.malloc(2 * MiB);  // the front of the cached 4 MiB; its other 2 MiB stay free at the end
  sim.malloc(30 * MiB);  // grows from that free end
  REQUIRE(sim.ledger().unmaps == 0);
  REQUIRE(sim.alloc.reserved() == 32 * MiB);
}

// ---- what a growth past the high mark costs ---------------------------------------------------
// Counted in blocks the unmapping walk looks at (GrowableSegments::blocks_visited), not timed.

TEST_CASE("growing past the high mark looks at no live block, however many there are", "[growable][high-mark][cost]") {
  VmSim sim;
  constexpr std::size_t kLive = 1000;  // one page each, never freed: every malloc grows past the high mark
  for (std::size_t i = 0; i < kLive; ++i) sim.alloc.malloc(kPage, kStream0);
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == kLive * kPage);
  REQUIRE(sim.ledger().maps == kLive);
  // A walk over every block of the segment would look at about kLive * kLive / 2 blocks.
  REQUIRE(sim.alloc.work_counts().growable_blocks_visited <= kLive);
}

namespace {

// `holes` free blocks of 2 pages on stream 0, each followed by a live page, so they never merge.
void free_holes_between_live_pages(VmSim& sim, std::size_t holes) {
  std::vector<Block*> freed;
  for (std::size_t i = 0; i < holes; ++i) {
    freed.push_back(sim.alloc.malloc(2 * kPage, kStream0));
    sim.alloc.malloc(kPage, kStream0);
  }
  for (Block* b : freed) sim.alloc.free(b);
}

}  // namespace

TEST_CASE("growing past the high mark looks at the free blocks it unmaps, not at every free block", "[growable][high-mark][cost]") {
  VmSim sim;
  constexpr std::size_t kHoles = 500;
  free_holes_between_live_pages(sim, kHoles);
  const std::size_t high = sim.alloc.reserved();
  // Each 3 pages, larger than any free block: the holes' pages serve it, two holes and then one
  // (the page left over from the two) in turn.
  constexpr std::size_t kGrowths = 100;
  const std::uint64_t before = sim.alloc.work_counts().growable_blocks_visited;
  for (std::size_t i = 0; i < kGrowths; ++i) sim.alloc.malloc(3 * kPage, kStream0);
  sim.alloc.check_invariants();
  REQUIRE(sim.ledger().peak == high);
  REQUIRE(sim.ledger().unmaps == kGrowths * 3 / 2);
  // What it unmaps, and at most 16 unmapped blocks as it chooses where to grow (twice a growth);
  // a walk over the segment would look at 3 * kHoles blocks each time.
  REQUIRE(sim.alloc.work_counts().growable_blocks_visited - before <= kGrowths * (2 + 2 * 16));
}

TEST_CASE("choosing where to grow looks at a bounded number of holes, however many pages were unmapped", "[growable][high-mark][cost]") {
  VmSim sim;
  constexpr std::size_t kHoles = 1000;
  free_holes_between_live_pages(sim, kHoles);
  sim.alloc.empty_cache();  // every hole's pages go back: 1,000 unmapped blocks between live ones
  // Each 3 pages: no hole holds it, and its neighbours are live; it grows at the segment's end.
  constexpr std::size_t kGrowths = 100;
  const std::uint64_t before = sim.alloc.work_counts().growable_blocks_visited;
  for (std::size_t i = 0; i < kGrowths; ++i) sim.alloc.malloc(3 * kPage, kStream0);
  sim.alloc.check_invariants();
  // Looking at every hole would be kHoles a choice, twice a growth.
  REQUIRE(sim.alloc.work_counts().growable_blocks_visited - before <= kGrowths * (2 + 2 * 16));
}

// ---- the cap --------------------------------------------------------------------------------

TEST_CASE("the cap counts mapped bytes: pages fit to the byte, and one byte more is refused", "[growable][cap]") {
  VmSim sim(6 * MiB);
  Block* a = sim.malloc(3 * MiB);  // 4 MiB of pages; the 1 MiB left over is not split off
  REQUIRE(a->size == 4 * MiB);
  Block* b = sim.malloc(2 * MiB);
  REQUIRE(sim.alloc.reserved() == 6 * MiB);
  const Oom oom = oom_from([&] { sim.alloc.malloc(512, kStream0); });
  REQUIRE(oom.info.kind == OomKind::kOverLimit);
  REQUIRE(sim.ledger().peak == 6 * MiB);
  (void)b;
}

// Eight 5 MiB blocks with every other one freed: 20 MiB or more live, the rest in holes of one
// block each, and a request of 20 MiB that no hole holds but the limit has room for.
std::vector<Block*> every_other_freed(VmSim& sim) {
  std::vector<Block*> all, live;
  for (int i = 0; i < 8; ++i) all.push_back(sim.malloc(5 * MiB));
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (i % 2 == 0) {
      live.push_back(all[i]);
    } else {
      sim.free(all[i]);
    }
  }
  return live;
}

TEST_CASE("scattered free memory is unmapped and mapped again where a large request needs it", "[growable][cap]") {
  VmSim sim(48 * MiB);
  const std::vector<Block*> live = every_other_freed(sim);
  std::vector<std::uintptr_t> addrs;
  for (const Block* b : live) addrs.push_back(b->addr);
  Block* big = sim.malloc(20 * MiB);
  REQUIRE(big->size == 20 * MiB);
  REQUIRE(sim.alloc.reserved() <= 48 * MiB);
  REQUIRE(sim.ledger().peak <= 48 * MiB);
  REQUIRE(sim.ledger().unmaps > 0);
  for (std::size_t i = 0; i < live.size(); ++i) {
    REQUIRE(live[i]->allocated);
    REQUIRE(live[i]->addr == addrs[i]);
    REQUIRE(sim.mapped(addrs[i]));
  }
}

TEST_CASE("plain segments fail the same scattered request that growable ones serve", "[growable][cap]") {
  VmSim sim(48 * MiB, /*growable=*/false);
  every_other_freed(sim);
  const Oom oom = oom_from([&] { sim.alloc.malloc(20 * MiB, kStream0); });
  REQUIRE(oom.info.kind == OomKind::kFragmentation);
}

TEST_CASE("a request fits whenever allocated bytes plus its pages are within the limit", "[growable][cap]") {
  // Live blocks every other 4 MiB: the free memory is all holes, and the request is larger than
  // any of them and than the mapped stretch's free end.
  VmSim sim(64 * MiB);
  std::vector<Block*> blocks;
  for (int i = 0; i < 14; ++i) blocks.push_back(sim.malloc(4 * MiB));
  for (std::size_t i = 0; i < blocks.size(); i += 2) sim.free(blocks[i]);
  const auto allocated = static_cast<std::size_t>(sim.alloc.stats().allocated_bytes[kAll].current);
  REQUIRE(allocated == 28 * MiB);
  Block* big = sim.malloc(64 * MiB - allocated);
  REQUIRE(big->size == 36 * MiB);
  REQUIRE(sim.ledger().peak <= 64 * MiB);
}

// ---- unmapping ------------------------------------------------------------------------------

TEST_CASE("empty_cache unmaps the free pages between live blocks and keeps the live ones", "[growable][release]") {
  VmSim sim;
  Block* a = sim.malloc(4 * MiB);
  Block* b = sim.malloc(8 * MiB);
  Block* c = sim.malloc(4 * MiB);
  const std::uintptr_t b_addr = b->addr;
  sim.free(b);
  sim.alloc.empty_cache();
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == 8 * MiB);
  REQUIRE(sim.ledger().mapped == 8 * MiB);
  REQUIRE_FALSE(sim.mapped(b_addr));
  REQUIRE(sim.mapped(a->addr));
  REQUIRE(sim.mapped(c->addr));
  REQUIRE(sim.alloc.snapshot().size() == 2);  // two mapped stretches either side of the hole
}

TEST_CASE("free memory that shares a page with a live block stays mapped", "[growable][release]") {
  VmSim sim;
  Block* x0 = sim.malloc(1 * MiB);  // small pool: 1 MiB blocks, two to a page
  Block* x1 = sim.malloc(1 * MiB);
  Block* x2 = sim.malloc(1 * MiB);
  REQUIRE(sim.alloc.reserved() == 4 * MiB);
  sim.free(x1);
  sim.alloc.empty_cache();
  REQUIRE(sim.alloc.reserved() == 4 * MiB);  // x1's page holds x0; x2's page holds x2
  sim.free(x0);
  sim.alloc.empty_cache();
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == 2 * MiB);
  REQUIRE(sim.mapped(x2->addr));
}

// ---- physical chunks (Note [physical chunks]) -----------------------------------------------

TEST_CASE("a large growth is mapped in a few chunks, a small one page by page", "[growable][chunks]") {
  VmSim sim;
  sim.malloc(1 * GiB);  // chunks of 8 MiB: the largest power-of-two pages within 1/128 of it
  REQUIRE(sim.ledger().maps == 1);
  REQUIRE(sim.ledger().allocations == 128);
  sim.malloc(510 * MiB);  // 255 pages: under 256, so a page each
  REQUIRE(sim.ledger().maps == 2);
  REQUIRE(sim.ledger().allocations == 128 + 255);
  sim.malloc(4 * GiB);  // chunks of 32 MiB
  REQUIRE(sim.ledger().allocations == 128 + 255 + 128);
  sim.alloc.check_invariants();
}

TEST_CASE("each growable segment maps chunks of one size: a request goes to the segment of its chunk", "[growable][chunks]") {
  VmSim sim;
  Block* paged = sim.malloc(100 * MiB);  // pages
  Block* chunked = sim.malloc(1 * GiB);  // chunks of 8 MiB: a segment of its own
  REQUIRE(paged->segment != chunked->segment);
  REQUIRE(paged->segment->chunk == kPage);
  REQUIRE(chunked->segment->chunk == 8 * MiB);
  for (const auto* segment : {paged->segment, chunked->segment}) {
    REQUIRE(!segment->chunks.empty());
    for (const std::uintptr_t addr : segment->chunks) REQUIRE(sim.backend.holds_whole_chunk(0, addr, segment->chunk));
  }
  sim.free(paged);
  sim.free(chunked);
  // Cut from either cached block, a block lies on chunks of one size.
  Block* again = sim.malloc(1100 * MiB);
  REQUIRE(again->segment->chunk == 8 * MiB);
  sim.alloc.check_invariants();
}

TEST_CASE("a growth maps whole chunks: the rest of the last one stays cached", "[growable][chunks]") {
  VmSim sim(std::nullopt, true, 0.0, /*large_chunk=*/16 * MiB);
  Block* a = sim.malloc(5 * MiB);
  REQUIRE(sim.ledger().allocations == 1);
  REQUIRE(sim.alloc.reserved() == 16 * MiB);
  Block* b = sim.malloc(10 * MiB);  // from the 11 MiB cached after a: no new chunk
  REQUIRE(sim.ledger().allocations == 1);
  REQUIRE(b->addr == a->addr + 5 * MiB);
  sim.malloc(126 * MiB);  // joins the 1 MiB left and maps 125 MiB more: 8 chunks of 16 MiB
  REQUIRE(sim.ledger().allocations == 1 + 8);
  REQUIRE(sim.alloc.reserved() == 9 * 16 * MiB);
  sim.alloc.check_invariants();
}

TEST_CASE("the least chunk of the large pool is a setting, in power-of-two pages", "[growable][chunks]") {
  VmSim sixteen(std::nullopt, true, 0.0, /*large_chunk=*/16 * MiB);
  sixteen.malloc(5 * MiB);
  REQUIRE(sixteen.alloc.reserved() == 16 * MiB);
  VmSim twenty(std::nullopt, true, 0.0, /*large_chunk=*/20 * MiB);
  twenty.malloc(5 * MiB);
  REQUIRE(twenty.alloc.reserved() == 32 * MiB);
  VmSim small(std::nullopt, true, 0.0, /*large_chunk=*/16 * MiB);
  for (int i = 0; i < 3; ++i) small.malloc(1 * MiB);  // the small pool maps pages whatever the setting
  REQUIRE(small.ledger().allocations == 2);
  REQUIRE(small.alloc.reserved() == 2 * kPage);
}

TEST_CASE("where the cap has no room for a whole chunk, the request is mapped page by page", "[growable][chunks][cap]") {
  VmSim sim(20 * MiB, true, 0.0, /*large_chunk=*/16 * MiB);
  Block* a = sim.malloc(15 * MiB);
  REQUIRE(sim.alloc.reserved() == 16 * MiB);
  Block* b = sim.malloc(3 * MiB);  // a second chunk would pass the cap: two pages of their own
  REQUIRE(sim.alloc.reserved() == 20 * MiB);
  REQUIRE(b->segment->chunk == kPage);
  REQUIRE(a->segment->chunk == 16 * MiB);
  REQUIRE(sim.stats().num_ooms == 0);
  const Oom oom = oom_from([&] { sim.malloc(4 * MiB); });
  REQUIRE(oom.info.reserved <= 20 * MiB);
  sim.free(a);
  sim.free(b);
  sim.alloc.check_invariants();
}

TEST_CASE("where the device has no room for a whole chunk, the request is mapped page by page", "[growable][chunks][fault]") {
  Sim sim(std::nullopt, 20 * MiB, 0.0, kPage, true, /*large_chunk=*/16 * MiB);
  sim.malloc(15 * MiB);
  Block* b = sim.malloc(3 * MiB);
  REQUIRE(b->segment->chunk == kPage);
  REQUIRE(sim.alloc.reserved() == 20 * MiB);
  REQUIRE(sim.stats().num_ooms == 0);
  sim.alloc.check_invariants();
}

TEST_CASE("chunks stop at 256 MiB however large the growth", "[growable][chunks]") {
  Sim sim(std::nullopt, 64 * GiB, 0.0, kPage, true);
  sim.malloc(60 * GiB + 2 * MiB);  // 241 chunks of 256 MiB: whole chunks, the rest of the last cached
  REQUIRE(sim.ledger().maps == 1);
  REQUIRE(sim.ledger().allocations == 241);
  sim.alloc.check_invariants();
}

TEST_CASE("a chunk that a live block shares stays mapped, the free chunks around it go", "[growable][chunks][release]") {
  VmSim sim;
  sim.free(sim.malloc(4 * GiB));
  Block* live = sim.malloc(10 * MiB);  // from the cached 4 GiB, at its start: inside the first chunk
  sim.alloc.empty_cache();
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == 32 * MiB);  // the first chunk, not the 10 MiB's 5 pages
  REQUIRE(sim.ledger().mapped == 32 * MiB);
  REQUIRE(sim.ledger().unmaps == 1);  // the 127 free chunks after it, in one call
  REQUIRE(sim.mapped(live->addr + 31 * MiB));
  sim.free(live);
  sim.alloc.empty_cache();
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == 0);
  REQUIRE(sim.ledger().in_use == 0);
}

TEST_CASE("a growth joined to a free block maps its own chunks; giving back takes only whole ones", "[growable][chunks][release]") {
  VmSim sim;
  Block* a = sim.malloc(100 * MiB);  // 50 pages, a page each
  Block* b = sim.malloc(2 * GiB);    // 16 MiB chunks
  sim.free(a);
  Block* c = sim.malloc(40 * MiB);   // the first 20 pages of a's block
  sim.alloc.empty_cache();           // the 30 free pages after c go; b's chunks are live
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == 40 * MiB + 2 * GiB);
  sim.free(b);
  sim.alloc.empty_cache();
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == 40 * MiB);
  REQUIRE(sim.mapped(c->addr));
}

TEST_CASE("empty_cache with nothing live gives back every page and address range", "[growable][release]") {
  VmSim sim;
  sim.free(sim.malloc(5 * MiB));
  sim.free(sim.malloc(4 * KiB));
  sim.free(sim.malloc(7 * MiB, kStream1));
  sim.alloc.empty_cache();
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == 0);
  REQUIRE(sim.ledger().in_use == 0);
  REQUIRE(sim.ledger().address_ranges == 0);
  REQUIRE(sim.alloc.stats().segment[kAll].current == 0);
}

TEST_CASE("unmapping synchronizes the device first", "[growable][release]") {
  VmSim sim;
  sim.free(sim.malloc(5 * MiB));
  const std::uint64_t syncs = sim.ledger().syncs;
  sim.alloc.empty_cache();
  REQUIRE(sim.ledger().syncs == syncs + 1);
  REQUIRE(sim.ledger().unmaps == 1);
}

TEST_CASE("nothing is unmapped while a pool target is active", "[growable][release][pools]") {
  VmSim sim;
  sim.free(sim.malloc(5 * MiB));
  const PoolId pool{1, 0};
  sim.alloc.create_pool(pool);
  sim.alloc.begin_allocate_to_pool(pool, [](StreamId s) { return s == kStream1; });
  sim.alloc.empty_cache();
  REQUIRE(sim.ledger().unmaps == 0);
  REQUIRE(sim.alloc.reserved() == 6 * MiB);
  sim.alloc.end_allocate_to_pool(pool);
  sim.alloc.empty_cache();
  REQUIRE(sim.alloc.reserved() == 0);
}

TEST_CASE("a block still used by another stream is not unmapped until its work is done", "[growable][release][streams]") {
  VmSim sim;
  Block* a = sim.malloc(6 * MiB);
  const std::uintptr_t addr = a->addr;
  sim.alloc.record_stream(a, kStream1);
  sim.free(a);
  sim.backend.fail_next(0);
  sim.alloc.set_limit(std::optional<std::size_t>(2 * MiB));  // lowering releases only free memory
  REQUIRE(sim.mapped(addr));
  sim.alloc.empty_cache();  // synchronizes: the event completes, then the pages go
  REQUIRE_FALSE(sim.mapped(addr));
  REQUIRE(sim.alloc.reserved() == 0);
}

TEST_CASE("lowering the limit unmaps free pages down to it and leaves the rest cached", "[growable][release][cap]") {
  VmSim sim;
  Block* live = sim.malloc(4 * MiB);
  Block* a = sim.malloc(10 * MiB);
  Block* b = sim.malloc(10 * MiB, kStream1);
  sim.free(a);
  sim.free(b);
  sim.alloc.set_limit(std::optional<std::size_t>(16 * MiB));
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() <= 16 * MiB);
  REQUIRE(sim.alloc.reserved() >= 14 * MiB);  // no more was given back than the limit asked
  REQUIRE(sim.mapped(live->addr));
}

TEST_CASE("the release threshold unmaps free pages once reserved passes it", "[growable][release]") {
  VmSim sim(100 * MiB, true, 0.5);
  Block* a = sim.malloc(30 * MiB);
  Block* b = sim.malloc(30 * MiB);
  sim.free(a);  // reserved 60 MiB > 50 MiB: a's pages go
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() <= 50 * MiB);
  REQUIRE(sim.mapped(b->addr));
}

// ---- refusals -------------------------------------------------------------------------------

TEST_CASE("one map the device refuses is absorbed by releasing free pages and retrying", "[growable][fault]") {
  VmSim sim;
  sim.free(sim.malloc(8 * MiB));
  Block* keep = sim.malloc(2 * MiB);
  sim.backend.fail_next(1);
  Block* b = sim.malloc(20 * MiB);
  REQUIRE(b->allocated);
  REQUIRE(sim.alloc.stats().num_alloc_retries == 1);
  REQUIRE(sim.ledger().refusals == 1);
  (void)keep;
}

TEST_CASE("a device that refuses every map ends in a device-full OOM and keeps nothing of the attempt", "[growable][fault]") {
  VmSim sim;
  sim.backend.fail_when([](int, std::size_t) { return true; });
  const Oom oom = oom_from([&] { sim.alloc.malloc(5 * MiB, kStream0); });
  REQUIRE(oom.info.kind == OomKind::kDeviceFull);
  sim.alloc.check_invariants();
  REQUIRE(sim.alloc.reserved() == 0);
  REQUIRE(sim.ledger().in_use == 0);
  REQUIRE(sim.ledger().address_ranges == 0);
  sim.backend.stop_failing();
  REQUIRE(sim.malloc(5 * MiB)->allocated);
}

// ---- views ----------------------------------------------------------------------------------

TEST_CASE("a snapshot shows one segment per mapped stretch, adding up to reserved", "[growable][snapshot]") {
  VmSim sim;
  Block* a = sim.malloc(4 * MiB);
  Block* b = sim.malloc(8 * MiB);
  Block* c = sim.malloc(4 * MiB);
  sim.free(b);
  sim.alloc.empty_cache();
  const std::vector<SegmentInfo> segments = sim.alloc.snapshot();
  REQUIRE(segments.size() == 2);
  REQUIRE(snapshot_bytes(segments) == sim.alloc.reserved());
  REQUIRE(std::all_of(segments.begin(), segments.end(), [](const SegmentInfo& s) { return s.growable; }));
  REQUIRE(segments[0].addr == a->addr);
  REQUIRE(segments[1].addr == c->addr);
}

TEST_CASE("segment_of names the mapped stretch that holds an address, and nothing for an unmapped one", "[growable][snapshot]") {
  VmSim sim;
  Block* a = sim.malloc(4 * MiB);
  Block* b = sim.malloc(8 * MiB);
  Block* c = sim.malloc(4 * MiB);
  const std::uintptr_t hole = b->addr;
  sim.free(b);
  sim.alloc.empty_cache();
  const auto of_c = sim.alloc.segment_of(reinterpret_cast<void*>(c->addr + 1));
  REQUIRE(of_c);
  REQUIRE(of_c->first == c->addr);
  REQUIRE(of_c->second == 4 * MiB);
  REQUIRE_FALSE(sim.alloc.segment_of(reinterpret_cast<void*>(hole)));
  REQUIRE(sim.alloc.segment_of(a->ptr())->first == a->addr);
}

TEST_CASE("destroying the allocator gives back every page and range, live blocks included", "[growable]") {
  SimBackend backend(kDeviceBytes);
  backend.enable_virtual_memory(kPage);
  {
    DeviceAllocator alloc(backend, 0, AllocatorConfig{});
    alloc.malloc(5 * MiB, kStream0);
    alloc.free(alloc.malloc(9 * MiB, kStream0));
    alloc.malloc(3 * KiB, kStream1);
  }
  REQUIRE(backend.ledger(0).in_use == 0);
  REQUIRE(backend.ledger(0).address_ranges == 0);
}

TEST_CASE("frees above a lowered limit unmap free pages until reserved is under it", "[growable][limit]") {
  VmSim sim(1000 * 1000 * 1000);
  free_everything_above_a_lowered_limit(sim);
  REQUIRE(sim.ledger().mapped <= 100 * 1000 * 1000);  // what is left is pages, unmapped as freed
}

namespace {

// A job whose shapes never settle: up to `live` blocks of 2 to 18 MiB held, one freed at random
// and another made at each step, so the holes rarely fit the next request.
struct Churn {
  std::vector<Block*> held;
  std::mt19937_64 rng{3};
  void step(VmSim& sim, std::size_t live = 7) {
    if (held.size() >= live) {
      const std::size_t k = rng() % held.size();
      sim.free(held[k]);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
    }
    held.push_back(sim.malloc((2 + 4 * (rng() % 5)) * MiB));
  }
  void end(VmSim& sim) {
    for (Block* b : held) sim.free(b);
    held.clear();
  }
};

}  // namespace

TEST_CASE("a job that keeps moving pages earns room past the high mark once it has moved a whole cache's worth",
          "[growable][high-mark]") {
  VmSim sim;
  Churn churn;
  int step = 0;
  while (sim.alloc.work_counts().growable_allowance == 0 && step < 20000) {
    const std::size_t moved_before = sim.alloc.work_counts().growable_moved;
    const std::size_t mark_before = sim.ledger().peak;  // reserved's high mark: only pages are reserved here
    churn.step(sim);
    ++step;
    const WorkCounts counts = sim.alloc.work_counts();
    if (counts.growable_allowance > 0) {
      // Granted at the step whose moves took the total to the mark: an eighth of the mark.
      REQUIRE(counts.growable_moved >= mark_before);
      REQUIRE(moved_before < mark_before);
      REQUIRE(counts.growable_allowance <= sim.ledger().peak / 8);
    }
  }
  INFO("steps: " << step);
  REQUIRE(sim.alloc.work_counts().growable_allowance > 0);
  // From now on growths pass the mark, within the allowance, instead of moving pages each time.
  const std::size_t mark = sim.ledger().peak;
  const std::size_t moved = sim.alloc.work_counts().growable_moved;
  const std::size_t allowance = sim.alloc.work_counts().growable_allowance;
  for (int i = 0; i < 200; ++i) churn.step(sim);
  const WorkCounts after = sim.alloc.work_counts();
  REQUIRE(sim.ledger().peak > mark);
  // Moves before the next grant are at most a mark's worth; the mark rose by at most what was granted.
  REQUIRE(after.growable_moved - moved <= sim.ledger().peak + 18 * MiB);
  REQUIRE(sim.ledger().peak <= mark + allowance + 2 * (allowance + 18 * MiB));
  churn.end(sim);
  sim.alloc.check_invariants();
}

TEST_CASE("a job whose every step moves the same pages earns the room that ends it, and no more", "[growable][high-mark]") {
  VmSim sim;
  // Each round: the 14 MiB request fits no hole of the 20 MiB the round before left, and moves pages.
  auto round = [&] {
    Block* a = sim.malloc(8 * MiB);
    Block* b = sim.malloc(4 * MiB);
    Block* c = sim.malloc(8 * MiB);
    sim.free(a);
    sim.free(c);
    sim.free(sim.malloc(14 * MiB));
    sim.free(b);
  };
  round();
  REQUIRE(sim.ledger().peak == 20 * MiB);  // the first time, pages move instead of the mark rising
  std::size_t moved_at_100 = 0;
  for (int i = 1; i < 200; ++i) {
    round();
    if (i == 100) moved_at_100 = sim.alloc.work_counts().growable_moved;
  }
  REQUIRE(sim.alloc.work_counts().growable_moved == moved_at_100);  // it stopped moving pages
  REQUIRE(sim.ledger().peak <= 26 * MiB);  // the mark passed by the 6 MiB the request lacked, no more
}
