// Reading a free set from its largest blocks down (core/largest_first.h): the order is (size
// descending, address ascending) over every size class of one stream, and a walk stays in that
// order while the blocks it gave are taken out and smaller ones put in.
#include <algorithm>
#include <deque>
#include <random>
#include <tuple>
#include <vector>

#include "core/largest_first.h"
#include "helpers.h"

using namespace gpumem_test;

namespace {

bool largest_first_order(const Block* a, const Block* b) {
  return std::make_tuple(~a->size, a->addr) < std::make_tuple(~b->size, b->addr);
}

// Free blocks of `stream` in a set: sizes from 512 B to 64 MiB in every kind of class, many of
// one size, at distinct addresses; plus blocks of another stream, which a walk never gives.
struct RandomSet {
  std::deque<Block> blocks;
  FreeBlocks set;
  std::vector<const Block*> mine;

  RandomSet(StreamId stream, unsigned seed, int count) {
    std::mt19937_64 rng(seed);
    const std::size_t sizes[] = {512, 4 * KiB, MiB, MiB + 512, 2 * MiB, 2 * MiB, 3 * MiB, 64 * MiB};
    for (int i = 0; i < count; ++i) {
      Block& b = blocks.emplace_back();
      b.stream = i % 5 == 4 ? stream + 1 : stream;
      b.size = rng() % 3 == 0 ? sizes[rng() % 8] : (rng() % (128 * 1024) + 1) * 512;
      b.addr = (static_cast<std::uintptr_t>(rng() % (1u << 20)) << 32) + static_cast<std::uintptr_t>(i) * 512;
      set.insert(&b);
      if (b.stream == stream) mine.push_back(&b);
    }
    std::sort(mine.begin(), mine.end(), largest_first_order);
  }
};

std::vector<const Block*> walk(const FreeBins& bins) {
  std::vector<const Block*> seen;
  for (const Block* b = largest_first::after(bins, largest_first::kStart); b;
       b = largest_first::after(bins, {b->size, b->addr})) {
    seen.push_back(b);
  }
  return seen;
}

}  // namespace

TEST_CASE("a largest-first walk gives every block of the stream, largest first, lowest address among equals", "[largest-first]") {
  for (unsigned seed = 1; seed <= 20; ++seed) {
    RandomSet r(kStream1, seed, 400);
    const FreeBins* bins = r.set.existing_bins(kStream1);
    REQUIRE(bins);
    REQUIRE(walk(*bins) == r.mine);
  }
}

TEST_CASE("a largest-first walk of an empty stream's bins gives nothing", "[largest-first]") {
  Block b;
  b.stream = kStream0;
  b.size = 4 * KiB;
  FreeBlocks set;
  set.insert(&b);
  set.erase(&b);
  REQUIRE(largest_first::after(*set.existing_bins(kStream0), largest_first::kStart) == nullptr);
}

TEST_CASE("a largest-first walk goes on in order while it takes out what it gave and puts in smaller blocks", "[largest-first]") {
  for (unsigned seed = 1; seed <= 20; ++seed) {
    RandomSet r(kStream0, seed, 400);
    std::deque<Block> added;
    std::vector<const Block*> seen;
    const FreeBins& bins = *r.set.existing_bins(kStream0);
    for (Block* b = largest_first::after(bins, largest_first::kStart); b;) {
      seen.push_back(b);
      const largest_first::Position at{b->size, b->addr};
      r.set.erase(b);
      if (b->size > 512) {  // as an unmapped block leaves cached remnants smaller than itself
        Block& remnant = added.emplace_back();
        remnant.stream = kStream0;
        remnant.size = b->size / 1024 * 512;
        remnant.addr = b->addr + 1;
        r.set.insert(&remnant);
      }
      b = largest_first::after(bins, at);
    }
    REQUIRE(seen.size() >= r.mine.size());
    REQUIRE(std::is_sorted(seen.begin(), seen.end(), largest_first_order));
    for (const Block* b : r.mine) REQUIRE(std::find(seen.begin(), seen.end(), b) != seen.end());
    r.set.check();
  }
}
