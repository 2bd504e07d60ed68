// Best fit, split and merge (free_set.h, split_merge.h), seen through the allocator: which block a request
// gets, what is left of the block it was cut from, and how freed blocks join their neighbours.
#include <algorithm>
#include <deque>
#include <random>
#include <set>
#include <tuple>

#include "helpers.h"

using namespace gpumem_test;

namespace {

// Blocks of a segment in address order, as (size, state) pairs, for compact comparisons.
std::vector<std::pair<std::size_t, BlockInfo::State>> layout(const SegmentInfo& s) {
  std::vector<std::pair<std::size_t, BlockInfo::State>> out;
  for (const BlockInfo& b : s.blocks) out.emplace_back(b.size, b.state);
  return out;
}

}  // namespace

// ---- best fit ---------------------------------------------------------------------------------

TEST_CASE("the smallest free block that fits is reused", "[split]") {
  Sim sim;
  // Free holes of 4, 8 and 16 KiB kept apart by live 512-byte blocks, then the free tail.
  Block* a = sim.malloc(4 * KiB);
  Block* sep1 = sim.malloc(512);
  Block* b = sim.malloc(8 * KiB);
  Block* sep2 = sim.malloc(512);
  Block* c = sim.malloc(16 * KiB);
  Block* sep3 = sim.malloc(512);
  const std::uintptr_t b_addr = b->addr;
  sim.free(a);
  sim.free(b);
  sim.free(c);

  Block* got = sim.malloc(6 * KiB);
  REQUIRE(got->addr == b_addr);
  REQUIRE(got->size == 6 * KiB);
  REQUIRE(sim.ledger().reserves == 1);
  (void)sep1, (void)sep2, (void)sep3;
}

TEST_CASE("a free block of exactly the size is preferred to a larger one", "[split]") {
  Sim sim;
  Block* big = sim.malloc(16 * KiB);
  Block* sep = sim.malloc(512);
  Block* exact = sim.malloc(4 * KiB);
  Block* sep2 = sim.malloc(512);
  const std::uintptr_t exact_addr = exact->addr;
  sim.free(big);
  sim.free(exact);

  Block* got = sim.malloc(4 * KiB);
  REQUIRE(got->addr == exact_addr);
  (void)sep, (void)sep2;
}

TEST_CASE("a free block on another stream is not reused", "[split][streams]") {
  Sim sim;
  Block* a = sim.malloc(4 * KiB, kStream1);
  const std::uintptr_t a_addr = a->addr;
  sim.free(a);

  Block* b = sim.malloc(4 * KiB, kStream2);
  REQUIRE(b->addr != a_addr);
  REQUIRE(sim.ledger().reserves == 2);
  REQUIRE(sim.segment_of(b).stream == kStream2);
}

TEST_CASE("a freed large block is reused for a smaller large request", "[split]") {
  Sim sim;
  Block* a = sim.malloc(12 * MiB);
  const std::uintptr_t a_addr = a->addr;
  sim.free(a);

  Block* b = sim.malloc(11 * MiB + 512);
  REQUIRE(b->addr == a_addr);
  REQUIRE(b->size == 12 * MiB);  // the 512 KiB left over is not split off in the large pool
  REQUIRE(sim.ledger().reserves == 1);
}

// ---- split ------------------------------------------------------------------------------------

TEST_CASE("a small block is split and the remainder kept free", "[split]") {
  Sim sim;
  Block* b = sim.malloc(1000);
  const SegmentInfo s = sim.segment_of(b);
  REQUIRE(layout(s) == std::vector<std::pair<std::size_t, BlockInfo::State>>{
                           {1024, BlockInfo::kAllocated}, {2 * MiB - 1024, BlockInfo::kFree}});
  REQUIRE(sim.alloc.largest_free_block() == 2 * MiB - 1024);
}

TEST_CASE("the kept remainder serves the next request in the same segment", "[split]") {
  Sim sim;
  Block* a = sim.malloc(1000);
  Block* b = sim.malloc(3000);
  REQUIRE(b->addr == a->addr + 1024);
  REQUIRE(sim.ledger().reserves == 1);
  REQUIRE(sim.segment_of(b).blocks.size() == 3);
}

TEST_CASE("a small block is split even for a 512-byte remainder", "[split]") {
  Sim sim;
  Block* whole = sim.malloc(MiB);
  Block* rest = sim.malloc(MiB - 512);
  const SegmentInfo s = sim.segment_of(rest);
  REQUIRE(s.small);
  REQUIRE(layout(s) == std::vector<std::pair<std::size_t, BlockInfo::State>>{
                           {MiB, BlockInfo::kAllocated}, {MiB - 512, BlockInfo::kAllocated}, {512, BlockInfo::kFree}});
  (void)whole;
}

TEST_CASE("a large-pool remainder of more than 1 MiB is split off", "[split]") {
  Sim sim;
  Block* b = sim.malloc(11 * MiB - 512);  // a 12 MiB segment; 1 MiB + 512 left
  REQUIRE(b->size == 11 * MiB - 512);
  const SegmentInfo s = sim.segment_of(b);
  REQUIRE(s.size == 12 * MiB);
  REQUIRE(layout(s) == std::vector<std::pair<std::size_t, BlockInfo::State>>{
                           {11 * MiB - 512, BlockInfo::kAllocated}, {MiB + 512, BlockInfo::kFree}});
}

TEST_CASE("a large-pool remainder of 1 MiB or less is not split off", "[split]") {
  Sim sim;
  Block* b = sim.malloc(11 * MiB);  // a 12 MiB segment; exactly 1 MiB left
  REQUIRE(b->size == 12 * MiB);
  REQUIRE(b->requested == 11 * MiB);
  const SegmentInfo s = sim.segment_of(b);
  REQUIRE(s.blocks.size() == 1);
  REQUIRE(sim.alloc.largest_free_block() == 0);
  REQUIRE(sim.stats().inactive_split[kAll].current == 0);
}

TEST_CASE("a mid-size request splits its 20 MiB segment", "[split]") {
  Sim sim;
  Block* a = sim.malloc(3 * MiB);
  Block* b = sim.malloc(5 * MiB);
  REQUIRE(b->addr == a->addr + 3 * MiB);
  const SegmentInfo s = sim.segment_of(a);
  REQUIRE(layout(s) == std::vector<std::pair<std::size_t, BlockInfo::State>>{
                           {3 * MiB, BlockInfo::kAllocated}, {5 * MiB, BlockInfo::kAllocated}, {12 * MiB, BlockInfo::kFree}});
  REQUIRE(sim.ledger().reserves == 1);
}

// ---- merge ------------------------------------------------------------------------------------

TEST_CASE("a freed block merges with a free next neighbour", "[merge]") {
  Sim sim;
  Block* a = sim.malloc(1024);
  Block* b = sim.malloc(1024);
  sim.free(b);  // joins the free tail
  const SegmentInfo s = sim.segment_of(a);
  REQUIRE(layout(s) == std::vector<std::pair<std::size_t, BlockInfo::State>>{
                           {1024, BlockInfo::kAllocated}, {2 * MiB - 1024, BlockInfo::kFree}});
}

TEST_CASE("a freed block merges with a free previous neighbour", "[merge]") {
  Sim sim;
  Block* a = sim.malloc(1024);
  Block* b = sim.malloc(1024);
  Block* c = sim.malloc(1024);
  sim.free(a);
  sim.free(b);
  const SegmentInfo s = sim.segment_of(c);
  REQUIRE(layout(s) == std::vector<std::pair<std::size_t, BlockInfo::State>>{
                           {2048, BlockInfo::kFree}, {1024, BlockInfo::kAllocated}, {2 * MiB - 3072, BlockInfo::kFree}});
}

TEST_CASE("a freed block merges with both neighbours into one", "[merge]") {
  Sim sim;
  Block* a = sim.malloc(1024);
  Block* b = sim.malloc(2048);
  Block* c = sim.malloc(4096);
  Block* keep = sim.malloc(512);
  const std::uintptr_t a_addr = a->addr;
  sim.free(a);
  sim.free(c);
  REQUIRE(sim.segment_of(b).blocks.size() == 5);
  sim.free(b);

  const SegmentInfo s = sim.segment_of(keep);
  REQUIRE(layout(s) == std::vector<std::pair<std::size_t, BlockInfo::State>>{
                           {7 * 1024, BlockInfo::kFree}, {512, BlockInfo::kAllocated}, {2 * MiB - 7 * 1024 - 512, BlockInfo::kFree}});
  REQUIRE(s.blocks[0].addr == a_addr);
  REQUIRE(sim.stats().inactive_split[kAll].current == 2);
}

TEST_CASE("freeing every block leaves the segment one free block", "[merge]") {
  Sim sim;
  Block* a = sim.malloc(1024);
  Block* b = sim.malloc(2048);
  Block* c = sim.malloc(4096);
  const std::uintptr_t seg = sim.segment_of(a).addr;
  sim.free(a);
  sim.free(c);
  sim.free(b);
  const auto snapshot = sim.snapshot();
  REQUIRE(snapshot.size() == 1);
  REQUIRE(snapshot[0].addr == seg);
  REQUIRE(layout(snapshot[0]) == std::vector<std::pair<std::size_t, BlockInfo::State>>{{2 * MiB, BlockInfo::kFree}});
  REQUIRE(sim.stats().inactive_split[kAll].current == 0);
  REQUIRE(sim.alloc.largest_free_block() == 2 * MiB);
}

TEST_CASE("free blocks of two adjacent segments are never merged", "[merge]") {
  Sim sim;
  Block* x = sim.malloc(MiB);  // first segment, first half
  Block* y = sim.malloc(MiB);  // first segment, second half: it is full
  Block* z = sim.malloc(MiB);  // second segment, right after the first in the device's addresses
  const SegmentInfo first = sim.segment_of(x);
  const SegmentInfo second = sim.segment_of(z);
  REQUIRE(second.addr == first.addr + first.size);  // the premise: the segments touch

  sim.free(y);  // the last block of the first segment
  sim.free(z);  // the first block of the second, right after y
  REQUIRE(layout(sim.segment_of(x)) == std::vector<std::pair<std::size_t, BlockInfo::State>>{
                                           {MiB, BlockInfo::kAllocated}, {MiB, BlockInfo::kFree}});
  const auto snapshot = sim.snapshot();
  REQUIRE(snapshot.size() == 2);
  REQUIRE(sim.alloc.largest_free_block() == 2 * MiB);

  sim.free(x);
  REQUIRE(sim.snapshot().size() == 2);
  sim.alloc.empty_cache();  // the device checks that each release matches a reserve exactly
  REQUIRE(sim.ledger().releases == 2);
  REQUIRE(sim.ledger().in_use == 0);
}

TEST_CASE("a block pending on another stream is not merged until its use ends", "[merge][streams]") {
  Sim sim;
  Block* a = sim.malloc(1024);
  Block* b = sim.malloc(1024);
  Block* c = sim.malloc(1024);
  sim.alloc.record_stream(b, kStream1);
  sim.free(b);
  sim.free(a);
  sim.free(c);
  const std::uintptr_t seg = sim.snapshot()[0].addr;
  REQUIRE(layout(sim.snapshot()[0]) == std::vector<std::pair<std::size_t, BlockInfo::State>>{
                                           {1024, BlockInfo::kFree}, {1024, BlockInfo::kPendingFree}, {2 * MiB - 2048, BlockInfo::kFree}});
  sim.backend.complete_events();
  sim.malloc(4 * MiB, kStream2);  // events are looked at when a request comes in
  const auto snapshot = sim.snapshot();
  const auto it = std::find_if(snapshot.begin(), snapshot.end(), [&](const SegmentInfo& s) { return s.addr == seg; });
  REQUIRE(it != snapshot.end());
  REQUIRE(layout(*it) == std::vector<std::pair<std::size_t, BlockInfo::State>>{{2 * MiB, BlockInfo::kFree}});
}

// ---- the block-level functions ------------------------------------------------------------------

TEST_CASE("take_best_fit ignores blocks of other streams even when they are smaller", "[split][streams]") {
  Block s1_small, s2_exact;
  s1_small.stream = 1;
  s1_small.size = 1024;
  s1_small.addr = 0x1000;
  s2_exact.stream = 2;
  s2_exact.size = 4096;
  s2_exact.addr = 0x9000;
  FreeBlocks set;
  set.insert(&s1_small);
  set.insert(&s2_exact);

  REQUIRE(set.take_best_fit(1, 2048) == nullptr);
  REQUIRE(set.take_best_fit(3, 512) == nullptr);
  REQUIRE(set.take_best_fit(2, 2048) == &s2_exact);
  REQUIRE(set.size() == 1);
  REQUIRE(set.contains(&s1_small));
  REQUIRE_FALSE(set.contains(&s2_exact));
}

TEST_CASE("take_best_fit breaks a tie of sizes by the lower address", "[split]") {
  Block high, low;
  high.size = low.size = 4096;
  high.addr = 0x8000;
  low.addr = 0x2000;
  FreeBlocks set;
  set.insert(&high);
  set.insert(&low);
  REQUIRE(set.take_best_fit(0, 4096) == &low);
}

TEST_CASE("a free set erases by the block's own position", "[split]") {
  Block a, b, c;
  a.size = 512, b.size = 1024, c.size = 2048;
  a.addr = 0x1000, b.addr = 0x2000, c.addr = 0x3000;
  FreeBlocks set;
  set.insert(&a);
  set.insert(&b);
  set.erase(&a);
  set.insert(&c);
  REQUIRE(set.size() == 2);
  REQUIRE_FALSE(set.contains(&a));
  REQUIRE(set.contains(&c));
  set.erase(&b);
  REQUIRE(set.take_best_fit(0, 512) == &c);
  REQUIRE(set.size() == 0);
}

// ---- the free set's bins: size classes and streams ---------------------------------------------

namespace {

Block make_block(StreamId stream, std::size_t size, std::uintptr_t addr) {
  Block b;
  b.stream = stream;
  b.size = size;
  b.addr = addr;
  return b;
}

}  // namespace

TEST_CASE("size classes are monotone in size and exact up to 1 MiB", "[split]") {
  REQUIRE(FreeBlocks::class_of(512) == 0);
  REQUIRE(FreeBlocks::class_of(1024) == 1);
  REQUIRE(FreeBlocks::class_of(MiB) == FreeBlocks::kExactClasses - 1);
  REQUIRE(FreeBlocks::class_of(MiB + 512) == FreeBlocks::kExactClasses);
  REQUIRE(FreeBlocks::class_of(~std::size_t{0}) == FreeBlocks::kClasses - 1);
  unsigned last = 0;
  for (std::size_t size = 512; size <= 64 * MiB; size += 512) {
    const unsigned cls = FreeBlocks::class_of(size);
    REQUIRE(cls >= last);
    REQUIRE(cls < FreeBlocks::kClasses);
    if (size <= MiB) REQUIRE(cls == size / 512 - 1);
    last = cls;
  }
}

TEST_CASE("take_best_fit passes over smaller blocks of the request's class to the next class", "[split]") {
  // 1 MiB + 512 and 1 MiB + 32 KiB share a large-pool class; the request lies between them.
  REQUIRE(FreeBlocks::class_of(MiB + 512) == FreeBlocks::class_of(MiB + 32 * KiB));
  Block below = make_block(0, MiB + 512, 0x1000);
  Block above = make_block(0, 3 * MiB, 0x9000);
  FreeBlocks set;
  set.insert(&below);
  set.insert(&above);
  REQUIRE(set.take_best_fit(0, MiB + 32 * KiB) == &above);
  REQUIRE(set.take_best_fit(0, MiB + 32 * KiB) == nullptr);
  REQUIRE(set.take_best_fit(0, MiB) == &below);
}

TEST_CASE("take_best_fit finds the smallest fitting block within a large class", "[split]") {
  Block a = make_block(0, MiB + 16 * KiB, 0x1000);
  Block b = make_block(0, MiB + 8 * KiB, 0x2000);
  Block c = make_block(0, MiB + 4 * KiB, 0x3000);
  FreeBlocks set;
  for (Block* x : {&a, &b, &c}) set.insert(x);
  REQUIRE(set.take_best_fit(0, MiB + 5 * KiB) == &b);
  REQUIRE(set.take_best_fit(0, MiB + 512) == &c);
}

TEST_CASE("a request too large for any class finds nothing", "[split]") {
  Block big = make_block(0, std::size_t{1} << 40, 0x1000);
  FreeBlocks set;
  set.insert(&big);
  REQUIRE(set.take_best_fit(0, ~std::size_t{0}) == nullptr);
  REQUIRE(set.take_best_fit(0, (std::size_t{1} << 40) + 512) == nullptr);
  REQUIRE(set.take_best_fit(0, 512) == &big);
}

TEST_CASE("blocks of many streams stay with their streams", "[split][streams]") {
  std::vector<Block> blocks;
  for (StreamId s = 0; s < 20; ++s) blocks.push_back(make_block(s * 7919, 512 * (s + 1), 0x1000 * (s + 1)));
  FreeBlocks set;
  for (Block& b : blocks) set.insert(&b);
  for (StreamId s = 20; s-- > 0;) {
    REQUIRE(set.take_best_fit(s * 7919 + 1, 512) == nullptr);
    REQUIRE(set.take_best_fit(s * 7919, 512) == &blocks[s]);
    REQUIRE(set.take_best_fit(s * 7919, 512) == nullptr);
  }
  REQUIRE(set.size() == 0);
}

// The free set against a std::set ordered by (stream, size, address), the definition of best fit:
// random inserts, erases and takes over a few streams, with many equal sizes (deep trees of one
// class) and sizes on both sides of the small/large boundary.
TEST_CASE("the free set agrees with an ordered set under random operations", "[split][property]") {
  using Key = std::tuple<StreamId, std::size_t, std::uintptr_t>;
  std::mt19937_64 rng(12345);
  std::deque<Block> storage;
  std::vector<Block*> idle, in_set;
  std::set<Key> reference;
  FreeBlocks set;
  const auto key = [](const Block* b) { return Key{b->stream, b->size, b->addr}; };
  const auto random_size = [&]() -> std::size_t {
    switch (rng() % 4) {
      case 0: return 512 * (1 + rng() % 4);                     // a few small sizes, many repeats
      case 1: return 512 * (1 + rng() % 2048);                  // any small size
      case 2: return MiB + 512 * (1 + rng() % 8192);            // the first large classes
      default: return 512 * (1 + rng() % (std::size_t{1} << 22));  // up to 2 GiB
    }
  };
  std::uintptr_t next_addr = 0x10000;
  for (int op = 0; op < 200000; ++op) {
    // Inserts lead while the set is small, so it grows to a few thousand blocks and stays there.
    const unsigned what = static_cast<unsigned>(rng() % 10) + (in_set.size() < 3000 ? 0 : 2);
    if (what < 6 || in_set.empty()) {
      if (idle.empty()) idle.push_back(&storage.emplace_back());
      Block* b = idle.back();
      idle.pop_back();
      *b = make_block(rng() % 3, random_size(), next_addr += 0x1000 * (1 + rng() % 4));
      set.insert(b);
      reference.insert(key(b));
      in_set.push_back(b);
    } else if (what < 8) {
      const std::size_t i = rng() % in_set.size();
      Block* b = in_set[i];
      in_set[i] = in_set.back();
      in_set.pop_back();
      set.erase(b);
      reference.erase(key(b));
      idle.push_back(b);
    } else {
      const StreamId stream = rng() % 4;  // stream 3 never has blocks
      const std::size_t size = random_size();
      auto it = reference.lower_bound(Key{stream, size, 0});
      Block* got = set.take_best_fit(stream, size);
      if (it == reference.end() || std::get<0>(*it) != stream) {
        REQUIRE(got == nullptr);
        continue;
      }
      REQUIRE(got != nullptr);
      REQUIRE(key(got) == *it);
      reference.erase(it);
      in_set.erase(std::find(in_set.begin(), in_set.end(), got));
      idle.push_back(got);
    }
    REQUIRE(set.size() == reference.size());
    if (op % 5000 == 0) {
      std::vector<Key> walked;
      set.for_each([&](const Block* b) { walked.push_back(key(b)); });
      REQUIRE(walked == std::vector<Key>(reference.begin(), reference.end()));
      for (const Block* b : in_set) REQUIRE(set.contains(b));
      for (const Block* b : idle) REQUIRE_FALSE(set.contains(b));
      REQUIRE_NOTHROW(set.check());  // balanced trees, bits that match them
    }
  }
}
