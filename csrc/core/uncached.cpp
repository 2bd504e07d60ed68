// Memory handed out while caching is off: core/uncached.h.
#include "core/uncached.h"

#include "core/errors.h"

namespace gpumem {

UncachedMemory::~UncachedMemory() {
  for (const auto& [addr, bytes] : blocks_) {
    quietly([&] { backend_.release(device_, reinterpret_cast<void*>(addr), bytes); });
  }
}

void* UncachedMemory::reserve(Cap& cap, std::size_t bytes, bool& device_refused) {
  void* ptr = cap.grow_noting(device_refused, bytes, [&] { return backend_.reserve(device_, bytes); });
  if (!ptr) return nullptr;
  blocks_.emplace(reinterpret_cast<std::uintptr_t>(ptr), bytes);
  bytes_ += bytes;
  return ptr;
}

bool UncachedMemory::release(Cap& cap, void* ptr) {
  const auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == blocks_.end()) return false;
  const std::size_t bytes = it->second;
  // The device's own free waits for work queued on the memory, as cudaFree does.
  backend_.release(device_, ptr, bytes);
  blocks_.erase(it);
  bytes_ -= bytes;
  cap.unreserve(bytes);
  return true;
}

}  // namespace gpumem
