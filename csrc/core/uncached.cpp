// Memory handed out while caching is off (torch.cuda.caching_allocator_enable(False)): each
// request is its own allocation from the device, given back to it when freed, as native does then.
//
// The cap still counts it: reserved bytes (the cap's) = segments' mapped bytes + uncached bytes.
// The statistics do not, as native's do not; snapshots do not list it either. To make room under
// the cap, the cache is emptied first, then the request is refused with an OutOfMemoryError.
#include "core/device_allocator.h"
#include "core/sizing.h"

namespace gpumem {

void* DeviceAllocator::malloc_uncached(std::size_t requested) {
  const WholeDevice whole(*this);
  if (requested > SIZE_MAX - kMinBlockSize) throw_oom(requested, requested);
  const std::size_t bytes = round_size(requested);
  measure_outside_locked();
  if (!fits_under(allocated_locked(), bytes, d_.cap.budget())) throw_oom(requested, bytes);
  bool device_refused = false;
  void* ptr = reserve_uncached(bytes, device_refused);
  if (!ptr && !d_.capturing()) {
    synchronize_and_process_events();
    release_all_unused();
    ptr = reserve_uncached(bytes, device_refused);
  }
  if (!ptr) throw_oom(requested, bytes, device_refused);
  debug_check();
  return ptr;
}

void* DeviceAllocator::reserve_uncached(std::size_t bytes, bool& device_refused) {
  void* ptr = d_.grow_noting(device_refused, bytes, [&] { return d_.backend.reserve(d_.device, bytes); });
  if (!ptr) return nullptr;
  uncached_.emplace(reinterpret_cast<std::uintptr_t>(ptr), bytes);
  uncached_bytes_ += bytes;
  return ptr;
}

bool DeviceAllocator::free_uncached(void* ptr) {
  const WholeDevice whole(*this);
  const auto it = uncached_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == uncached_.end()) return false;
  const std::size_t bytes = it->second;
  // The device's own free waits for work queued on the memory, as cudaFree does.
  d_.backend.release(d_.device, ptr, bytes);
  uncached_.erase(it);
  uncached_bytes_ -= bytes;
  d_.cap.unreserve(bytes);
  debug_check();
  return true;
}

std::size_t DeviceAllocator::uncached_bytes() const {
  const WholeDevice whole(*this);
  return uncached_bytes_;
}

}  // namespace gpumem
