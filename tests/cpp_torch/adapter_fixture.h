// The torch adapter over a simulated device: no GPU, no CUDA driver. The current device and
// stream come from a FakeCudaContext the test sets.
#pragma once

#include <cstddef>
#include <memory>

#include "backends/sim_backend.h"
#include "torch/allocator.h"

namespace gpumem::testing {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

struct FakeCudaContext final : CudaContext {
  int device = 0;
  StreamId stream = 0;
  int current_device() override { return device; }
  StreamId current_stream(int) override { return stream; }
  void on_device(int on, const std::function<void()>& f) override {
    const int before = device;
    device = on;
    try {
      f();
    } catch (...) {
      device = before;
      throw;
    }
    device = before;
  }
};

// A fresh adapter per test: `capacity` bytes on each of `devices` simulated devices, which map pages
// of `page_size` bytes (growable segments in use) unless it is 0.
struct SimAdapter {
  explicit SimAdapter(std::size_t capacity = 1 * GiB, int devices = 2, std::size_t page_size = 0)
      : backend(capacity, devices) {
    // Before any device's allocator exists (they are made on first use), which reads the page size.
    if (page_size > 0) backend.enable_virtual_memory(page_size);
  }

  SimBackend backend;
  std::unique_ptr<FakeCudaContext> owned_context = std::make_unique<FakeCudaContext>();
  FakeCudaContext& context = *owned_context;
  TorchAllocator adapter{backend, std::move(owned_context)};

  DeviceAllocator& core_device(int device = 0) { return adapter.core().device(device); }
  std::size_t reserved(int device = 0) { return core_device(device).reserved(); }
};

inline std::uintptr_t address_of(const c10::DataPtr& ptr) { return reinterpret_cast<std::uintptr_t>(ptr.get()); }

}  // namespace gpumem::testing
