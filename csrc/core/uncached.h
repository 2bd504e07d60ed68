// Memory handed out while caching is off (torch.cuda.caching_allocator_enable(False)): each
// request is its own allocation from the device, given back to it when freed, as native does then.
//
// The cap counts it, and so do the statistics: each allocation is a segment of the large pool, reserved,
// holding one allocated block (Note [caching off in the statistics]); snapshots do not list it.
// Making room for it under the cap, and refusing it, is the chain's (core/device_core.h).
//
// Note [caching off in the statistics]
//   Native counts nothing while caching is off: its reserved_bytes and allocated_bytes stay 0
//   while the memory is in use. gpumem counts it, so that reserved is one figure everywhere: what
//   the device handed gpumem, the bytes the limit is checked against, the same in memory_stats,
//   the report, the metrics and gpumem top (docs/monitoring.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "core/accounts.h"
#include "core/backend.h"

namespace gpumem {

class UncachedMemory {
 public:
  UncachedMemory(Backend& backend, int device) : backend_(backend), device_(device) {}
  ~UncachedMemory();  // gives everything back, quietly: the device may be gone
  UncachedMemory(const UncachedMemory&) = delete;
  UncachedMemory& operator=(const UncachedMemory&) = delete;

  // `bytes` from the device, counted in `accounts` (`requested` of them asked for), or nullptr (a
  // refusal by the device, noted in `device_refused`, or by the cap).
  void* reserve(Accounts& accounts, std::size_t bytes, std::size_t requested, bool& device_refused);
  // Gives `ptr` back to the device and to `accounts`; false if it did not come from reserve.
  bool release(Accounts& accounts, void* ptr);
  std::size_t bytes() const { return bytes_; }
  // fn(bytes, requested) for each allocation (the invariant checker's recount).
  template <class Fn>
  void for_each(Fn&& fn) const {
    for (const auto& [addr, held] : blocks_) fn(held.bytes, held.requested);
  }

 private:
  Backend& backend_;
  const int device_;
  struct Held {
    std::size_t bytes, requested;
  };
  std::unordered_map<std::uintptr_t, Held> blocks_;  // by address
  std::size_t bytes_ = 0;
};

}  // namespace gpumem
