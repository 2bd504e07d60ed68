// Blocks by address: what CachingAllocator's raw pointers (raw_alloc, raw_free) are found through.
//
// Design note. Every raw malloc+free pair inserts and takes one address, so the table must cost a
// few dozen instructions and allocate nothing: a node-based map (std::unordered_map) allocated and
// freed a node per pair, a heap round trip as dear as the cached path itself. This is an open
// addressing table with linear probing over (address, block) slots; the hash is Fibonacci hashing
// of the address above its 512-byte alignment. A taken address's slot is refilled by shifting back
// the entries of its probe run (no tombstones), so a lookup never probes past the run of its
// address, however many addresses came and went. The table doubles when it is half full and never
// shrinks.
//
// Not thread-safe: the caller locks (CachingAllocator holds one per shard).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/block.h"

namespace gpumem {

class AddressTable {
 public:
  AddressTable() : slots_(kInitialSlots) {}

  // Files `block` under its address, replacing a block filed there before.
  void insert(Block* block) {
    if (2 * count_ > mask_) grow();  // half full once this one is in
    if (Slot* slot = place(block->addr); slot->block) {
      slot->block = block;
    } else {
      *slot = {block->addr, block};
      ++count_;
    }
  }
  // The block filed under `addr`, or nullptr.
  Block* find(std::uintptr_t addr) const {
    for (std::size_t i = home(addr);; i = next(i)) {
      const Slot& slot = slots_[i];
      if (!slot.block || slot.addr == addr) return slot.block;
    }
  }
  // Takes the block filed under `addr` out of the table and returns it; nullptr if none is.
  Block* take(std::uintptr_t addr) {
    std::size_t hole = home(addr);
    for (;; hole = next(hole)) {
      const Slot& slot = slots_[hole];
      if (!slot.block) return nullptr;
      if (slot.addr == addr) break;
    }
    Block* const block = slots_[hole].block;
    // The entries after the hole, up to the run's end, move back into it unless their home lies
    // after the hole (cyclically, in (hole, i]): then a lookup from their home still finds them.
    for (std::size_t i = next(hole); slots_[i].block; i = next(i)) {
      const std::size_t h = home(slots_[i].addr);
      const bool stays = hole <= i ? (hole < h && h <= i) : (hole < h || h <= i);
      if (stays) continue;
      slots_[hole] = slots_[i];
      hole = i;
    }
    slots_[hole] = Slot{};
    --count_;
    return block;
  }
  std::size_t size() const { return count_; }

 private:
  struct Slot {
    std::uintptr_t addr = 0;
    Block* block = nullptr;  // nullptr: the slot is empty
  };
  static constexpr unsigned kInitialBits = 6;
  static constexpr std::size_t kInitialSlots = std::size_t{1} << kInitialBits;

  std::size_t home(std::uintptr_t addr) const {
    return static_cast<std::size_t>(((addr >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  std::size_t next(std::size_t i) const { return (i + 1) & mask_; }
  // The slot holding `addr`, or the empty slot where it would go.
  Slot* place(std::uintptr_t addr) {
    for (std::size_t i = home(addr);; i = next(i)) {
      Slot& slot = slots_[i];
      if (!slot.block || slot.addr == addr) return &slot;
    }
  }
  void grow();  // out of line: it runs once per doubling

  std::vector<Slot> slots_;
  std::size_t count_ = 0;
  unsigned shift_ = 64 - kInitialBits;  // 64 - log2(slots_.size())
  std::size_t mask_ = kInitialSlots - 1;  // slots_.size() - 1, kept: every probe step reads it
};

}  // namespace gpumem
