// Raw allocations by address (core/address_table.h): taking an entry out, and growing the table.
#include "core/address_table.h"

namespace gpumem {

Block* AddressTable::take(std::uintptr_t addr) {
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

void AddressTable::grow() {
  std::vector<Slot> old(slots_.size() * 2);
  old.swap(slots_);
  --shift_;
  count_ = 0;
  for (const Slot& slot : old) {
    if (slot.block) {
      *place(slot.addr) = slot;
      ++count_;
    }
  }
}

}  // namespace gpumem
