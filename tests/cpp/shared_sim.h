// A simulated GPU shared by several processes (forked by a test) or several allocators of one
// process: the device's capacity and its bytes in use live in a MAP_SHARED page, so one member's
// reserve leaves that much less for all. Each member has its own SharedSim over it (addresses are
// each member's own, as on a real GPU where each process has its own address space). Plain
// segments only. The shared ledger is the independent witness: `peak` is the most the members
// held at once, whatever they report.
//
// Invariant: 0 <= in_use <= capacity, at every instant (reserve is a compare-and-swap).
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <new>
#include <sys/mman.h>

#include "backends/sim_backend.h"

namespace gpumem_test {

struct SharedDevice {
  std::size_t capacity = 0;
  std::atomic<std::size_t> in_use{0};
  std::atomic<std::size_t> peak{0};

  // In a fresh shared mapping, so that children forked after it share it; never unmapped (a test
  // process's lifetime).
  static SharedDevice& make(std::size_t capacity) {
    void* page = ::mmap(nullptr, sizeof(SharedDevice), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) throw std::bad_alloc();
    auto* device = new (page) SharedDevice;
    device->capacity = capacity;
    return *device;
  }
  bool take(std::size_t bytes) {
    std::size_t now = in_use.load();
    do {
      if (bytes > capacity - now) return false;
    } while (!in_use.compare_exchange_weak(now, now + bytes));
    std::size_t high = peak.load();
    while (now + bytes > high && !peak.compare_exchange_weak(high, now + bytes)) {}
    return true;
  }
  void give(std::size_t bytes) { in_use.fetch_sub(bytes); }
};

// One member's view of the shared device: its own fake addresses, the shared capacity.
class SharedSim : public gpumem::SimBackend {
 public:
  // With `page`, it maps pages of that size (growable segments).
  explicit SharedSim(SharedDevice& device, std::size_t page = 0) : SimBackend(device.capacity), device_(device) {
    if (page > 0) enable_virtual_memory(page);
  }

  void* reserve(int device, std::size_t bytes) override {
    if (!device_.take(bytes)) return nullptr;
    void* ptr = SimBackend::reserve(device, bytes);
    if (!ptr) device_.give(bytes);
    return ptr;
  }
  void release(int device, void* ptr, std::size_t bytes) override {
    SimBackend::release(device, ptr, bytes);
    device_.give(bytes);
  }
  // Pages of growable segments come from the shared device too.
  bool map(int device, void* ptr, std::size_t bytes, std::size_t chunk) override {
    if (!device_.take(bytes)) return false;
    if (SimBackend::map(device, ptr, bytes, chunk)) return true;
    device_.give(bytes);
    return false;
  }
  void unmap(int device, void* ptr, std::size_t bytes) override {
    if (before_unmap) before_unmap();
    SimBackend::unmap(device, ptr, bytes);
    device_.give(bytes);
  }
  // Called as each unmap begins (set before the member's threads start): a test holds a release
  // part way with it.
  std::function<void()> before_unmap;

  gpumem::MemInfo mem_info(int) override {
    const std::size_t used = device_.in_use.load();
    return {device_.capacity - used, device_.capacity};
  }

 private:
  SharedDevice& device_;
};

}  // namespace gpumem_test
