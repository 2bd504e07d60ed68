// Raw allocations by address (core/address_table.h): growing the table.
#include "core/address_table.h"

namespace gpumem {

void AddressTable::grow() {
  std::vector<Slot> old(slots_.size() * 2);
  old.swap(slots_);
  --shift_;
  mask_ = slots_.size() - 1;
  count_ = 0;
  for (const Slot& slot : old) {
    if (slot.block) {
      *place(slot.addr) = slot;
      ++count_;
    }
  }
}

}  // namespace gpumem
