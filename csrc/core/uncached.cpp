// Memory handed out while caching is off: core/uncached.h.
#include "core/uncached.h"

#include "core/errors.h"

namespace gpumem {

UncachedMemory::~UncachedMemory() {
  for (const auto& [addr, held] : blocks_) {
    quietly([&] { backend_.release(device_, reinterpret_cast<void*>(addr), held.bytes); });
  }
}

void* UncachedMemory::reserve(Cap& cap, StatLedger& stats, std::size_t bytes, std::size_t requested,
                              bool& device_refused) {
  void* ptr = cap.grow_noting(device_refused, bytes, [&] { return backend_.reserve(device_, bytes); });
  if (!ptr) return nullptr;
  blocks_.emplace(reinterpret_cast<std::uintptr_t>(ptr), Held{bytes, requested});
  bytes_ += bytes;
  stats.reserve(false, bytes, 1);
  stats.hand_out(false, bytes, requested);
  ++stats.num_device_alloc;
  return ptr;
}

bool UncachedMemory::release(Cap& cap, StatLedger& stats, void* ptr) {
  const auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == blocks_.end()) return false;
  const auto [bytes, requested] = it->second;
  // The device's own free waits for work queued on the memory, as cudaFree does.
  backend_.release(device_, ptr, bytes);
  blocks_.erase(it);
  bytes_ -= bytes;
  stats.release(false, bytes);
  stats.settle(false, requested);
  stats.unreserve(false, bytes, 1);
  ++stats.num_device_free;
  cap.unreserve(bytes);
  return true;
}

}  // namespace gpumem
