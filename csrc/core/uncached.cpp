// Memory handed out while caching is off: core/uncached.h.
#include "core/uncached.h"

#include "core/errors.h"

namespace gpumem {

UncachedMemory::~UncachedMemory() {
  for (const auto& entry : blocks_) {  // not a structured binding: lambdas capture those only from C++20
    quietly([&] { backend_.release(device_, reinterpret_cast<void*>(entry.first), entry.second.bytes); });
  }
}

void* UncachedMemory::reserve(Accounts& accounts, std::size_t bytes, std::size_t requested, bool& device_refused) {
  void* ptr = accounts.map_uncached(device_refused, bytes, requested, [&] { return backend_.reserve(device_, bytes); });
  if (!ptr) return nullptr;
  blocks_.emplace(reinterpret_cast<std::uintptr_t>(ptr), Held{bytes, requested});
  bytes_ += bytes;
  return ptr;
}

bool UncachedMemory::release(Accounts& accounts, void* ptr) {
  const auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == blocks_.end()) return false;
  const auto [bytes, requested] = it->second;
  // The device's own free waits for work queued on the memory, as cudaFree does.
  backend_.release(device_, ptr, bytes);
  blocks_.erase(it);
  bytes_ -= bytes;
  accounts.unmap_uncached(bytes, requested);
  return true;
}

}  // namespace gpumem
