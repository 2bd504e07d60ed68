// The table of blocks by address behind raw_alloc and raw_free (core/address_table.h): it finds
// exactly what was filed and not taken, through growth and through the back-shifts of its takes.
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "core/address_table.h"
#include "helpers.h"

using namespace gpumem;

namespace {

// Blocks at 512-byte steps from a base: close addresses, so probe runs form and cross the end.
struct Blocks {
  explicit Blocks(std::size_t n) : all(n) {
    for (std::size_t i = 0; i < n; ++i) all[i].addr = 0x7f0000000000 + 512 * i;
  }
  std::vector<Block> all;
};

void require_same(const AddressTable& table, const std::map<std::uintptr_t, Block*>& model, const Blocks& blocks) {
  REQUIRE(table.size() == model.size());
  for (const Block& b : blocks.all) {
    const auto it = model.find(b.addr);
    REQUIRE(table.find(b.addr) == (it == model.end() ? nullptr : it->second));
  }
}

}  // namespace

TEST_CASE("the address table finds what was filed and not taken, through random inserts and takes", "[address_table]") {
  Blocks blocks(3000);
  AddressTable table;
  std::map<std::uintptr_t, Block*> model;
  std::mt19937_64 rng(3);
  for (int op = 0; op < 60000; ++op) {
    Block* b = &blocks.all[rng() % blocks.all.size()];
    // Grow to about a thousand live addresses, then hover there.
    if (rng() % 100 < (model.size() < 1000 ? 70u : 50u)) {
      table.insert(b);
      model[b->addr] = b;
    } else {
      const auto it = model.find(b->addr);
      REQUIRE(table.take(b->addr) == (it == model.end() ? nullptr : it->second));
      if (it != model.end()) model.erase(it);
    }
    if (op % 5000 == 0) require_same(table, model, blocks);
  }
  require_same(table, model, blocks);
  for (const auto& [addr, block] : model) REQUIRE(table.take(addr) == block);
  REQUIRE(table.size() == 0);
  for (const Block& b : blocks.all) REQUIRE(table.find(b.addr) == nullptr);
}

TEST_CASE("filing a block under an address filed already replaces it, and taking an absent address changes nothing",
          "[address_table]") {
  Blocks blocks(2);
  Block other;
  other.addr = blocks.all[0].addr;
  AddressTable table;
  table.insert(&blocks.all[0]);
  table.insert(&other);
  REQUIRE(table.size() == 1);
  REQUIRE(table.find(other.addr) == &other);
  REQUIRE(table.take(blocks.all[1].addr) == nullptr);
  REQUIRE(table.size() == 1);
  REQUIRE(table.take(other.addr) == &other);
  REQUIRE(table.take(other.addr) == nullptr);
  REQUIRE(table.size() == 0);
}
