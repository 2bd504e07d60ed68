// All devices of one backend (core/caching_allocator.h): making devices on first use, the deferred setup, free by address.
#include "core/caching_allocator.h"

#include <algorithm>
#include <string>

namespace gpumem {

CachingAllocator::CachingAllocator(Backend& backend, AllocatorConfig defaults)
    : backend_(backend), defaults_(defaults) {}

int CachingAllocator::count_devices() const {
  std::call_once(counted_, [this] {
    const int count = backend_.device_count();
    configs_.assign(count, defaults_);
    devices_.resize(count);
    ready_ = std::vector<std::atomic<DeviceAllocator*>>(count);
    count_.store(count, std::memory_order_release);
  });
  return count_.load(std::memory_order_acquire);
}

void CachingAllocator::defer_setup(std::function<void(CachingAllocator&)> setup) {
  std::lock_guard<std::recursive_mutex> lock(setup_mutex_);
  setup_ = std::move(setup);
  setup_pending_.store(static_cast<bool>(setup_), std::memory_order_release);
}

void CachingAllocator::run_setup() {
  if (!setup_pending_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::recursive_mutex> lock(setup_mutex_);
  if (!setup_pending_.load(std::memory_order_relaxed) || setup_running_) return;
  setup_running_ = true;
  try {
    setup_(*this);
  } catch (...) {
    setup_running_ = false;
    throw;
  }
  setup_running_ = false;
  setup_ = nullptr;
  setup_pending_.store(false, std::memory_order_release);
}

void CachingAllocator::check_index(int index) const {
  if (index >= 0 && index < device_count()) return;
  const std::string range = device_count() == 0 ? "there are no devices" : "devices are 0.." + std::to_string(device_count() - 1);
  throw DeviceError("gpumem: device " + std::to_string(index) + " does not exist; " + range);
}

DeviceAllocator& CachingAllocator::make_device(int index) {
  check_index(index);
  run_setup();
  std::lock_guard<std::mutex> lock(create_mutex_);
  if (!devices_[index]) {
    auto device = std::make_unique<DeviceAllocator>(backend_, index, configs_[index]);
    for (std::size_t slot = 0; slot < pressure_shares_.size(); ++slot) {
      device->watch_pressure(static_cast<int>(slot), pressure_shares_[slot]);
    }
    devices_[index] = std::move(device);
    ready_[index].store(devices_[index].get(), std::memory_order_release);
  }
  return *devices_[index];
}

DeviceAllocator* CachingAllocator::existing(int index) const {
  check_index(index);
  return ready_[index].load(std::memory_order_acquire);
}

std::vector<DeviceAllocator*> CachingAllocator::existing_devices() const {
  std::vector<DeviceAllocator*> out;
  const int count = count_.load(std::memory_order_acquire);  // -1 until counted: no devices
  for (int i = 0; i < count; ++i) {
    if (DeviceAllocator* ready = ready_[i].load(std::memory_order_acquire)) out.push_back(ready);
  }
  return out;
}

void CachingAllocator::watch_pressure(double share) {
  check_pressure_share(share);
  std::lock_guard<std::mutex> lock(create_mutex_);
  if (std::find(pressure_shares_.begin(), pressure_shares_.end(), share) != pressure_shares_.end()) return;
  if (pressure_shares_.size() == static_cast<std::size_t>(kMaxPressureWatches)) {
    throw LimitSpecError({"pressure share", std::to_string(share),
                          "at most " + std::to_string(kMaxPressureWatches) + " different shares can be watched, and " +
                              std::to_string(kMaxPressureWatches) + " are; reuse one of them",
                          "", ""});
  }
  pressure_shares_.push_back(share);
  // Before the devices are counted none exists, and devices_ may be being sized: a device made
  // later takes the shares in make_device.
  if (count_.load(std::memory_order_acquire) < 0) return;
  const int slot = static_cast<int>(pressure_shares_.size() - 1);
  for (const auto& device : devices_) {
    if (device) device->watch_pressure(slot, share);
  }
}

AllocatorConfig CachingAllocator::config(int index) {
  check_index(index);
  run_setup();
  std::lock_guard<std::mutex> lock(create_mutex_);
  return configs_[index];
}

void CachingAllocator::configure(int index, const AllocatorConfig& config) {
  check_index(index);
  run_setup();
  std::lock_guard<std::mutex> lock(create_mutex_);
  if (DeviceAllocator* ready = devices_[index].get()) {
    check_release_threshold(config.release_threshold);  // before anything changes
    check_large_chunk(config.large_chunk);
    ready->set_limit(config.limit);
    ready->set_release_threshold(config.release_threshold);
    ready->set_growable(config.growable);
    ready->set_large_chunk(config.large_chunk);
    ready->set_scope(config.scope);
  }
  configs_[index] = config;
}

void CachingAllocator::raw_free(void* ptr) {
  Block* block = take_raw(ptr);
  if (!block) throw std::invalid_argument("gpumem: raw_free of a pointer that raw_alloc did not return");
  free(block);
}

Block* CachingAllocator::find_raw(void* ptr) const {
  Shard& s = shard(ptr);
  std::lock_guard<Lock> lock(s.lock);
  return s.blocks.find(reinterpret_cast<std::uintptr_t>(ptr));
}

bool CachingAllocator::raw_record_stream(void* ptr, StreamId stream) {
  Block* block = find_raw(ptr);
  if (!block) return false;
  record_stream(block, stream);
  return true;
}

}  // namespace gpumem
