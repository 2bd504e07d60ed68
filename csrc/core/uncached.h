// Memory handed out while caching is off (torch.cuda.caching_allocator_enable(False)): each
// request is its own allocation from the device, given back to it when freed, as native does then.
//
// The cap still counts it: reserved bytes (the cap's) = segments' mapped bytes + uncached bytes.
// The statistics do not, as native's do not; snapshots do not list it either. Making room for it
// under the cap, and refusing it, is the chain's (core/device_core.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "core/backend.h"
#include "core/cap.h"

namespace gpumem {

class UncachedMemory {
 public:
  UncachedMemory(Backend& backend, int device) : backend_(backend), device_(device) {}
  ~UncachedMemory();  // gives everything back, quietly: the device may be gone
  UncachedMemory(const UncachedMemory&) = delete;
  UncachedMemory& operator=(const UncachedMemory&) = delete;

  // `bytes` from the device under `cap`, or nullptr (a refusal by the device noted in `device_refused`).
  void* reserve(Cap& cap, std::size_t bytes, bool& device_refused);
  // Gives `ptr` back to the device and to `cap`; false if it did not come from reserve.
  bool release(Cap& cap, void* ptr);
  std::size_t bytes() const { return bytes_; }

 private:
  Backend& backend_;
  const int device_;
  std::unordered_map<std::uintptr_t, std::size_t> blocks_;  // address -> bytes
  std::size_t bytes_ = 0;
};

}  // namespace gpumem
