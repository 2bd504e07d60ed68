// All devices of one backend: one DeviceAllocator each, created on first use, and a table of raw
// pointers for callers that free by address (the CUDAAllocator's raw_alloc / raw_delete).
//
// Nothing is asked of the backend until a caller needs a device (see Note [no CUDA before first
// use] in backends/cuda_backend.cpp): the devices are counted on first need, and a setup handed in
// before that (defer_setup) runs once, right before the first device's allocator is made or
// configured.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "core/address_table.h"
#include "core/device_allocator.h"
#include "core/lock.h"

namespace gpumem {

class CachingAllocator {
 public:
  CachingAllocator(Backend& backend, AllocatorConfig defaults = {});

  Backend& backend() { return backend_; }

  // Counts the devices on the first call (the backend's first call).
  int device_count() const {
    const int count = count_.load(std::memory_order_acquire);
    return count >= 0 ? count : count_devices();
  }
  // Throws DeviceError naming the index and the devices there are.
  DeviceAllocator& device(int index) {
    if (index >= 0 && index < count_.load(std::memory_order_acquire)) {  // -1 until counted
      if (DeviceAllocator* ready = ready_[index].load(std::memory_order_acquire)) return *ready;
    }
    return make_device(index);
  }
  // The device's allocator if it was created; nullptr otherwise (nothing allocated there yet).
  DeviceAllocator* existing(int index) const;
  // The devices whose allocator was created. Counts no devices: before anything was asked of the
  // backend there are none (monitoring must not start CUDA).
  std::vector<DeviceAllocator*> existing_devices() const;
  // Watches every device, those made later included, for reserved passing `share` of its limit
  // (core/pressure.h). The same share twice is one watch. Throws LimitSpecError, changing nothing,
  // for a share outside (0, 1] or one more share than kMaxPressureWatches.
  void watch_pressure(double share);
  // Settings for a device: applied now if its allocator exists, else when it is created.
  void configure(int index, const AllocatorConfig& config);
  // The config a device has, or will be created with.
  AllocatorConfig config(int index);

  // `setup` runs once, before the first device is made or configured, with the devices countable;
  // it typically configures them from settings read earlier. If it throws, nothing is made, the
  // error reaches the caller, and it runs again at the next such call: a device is never made
  // without it. Replaces a setup that has not run yet.
  void defer_setup(std::function<void(CachingAllocator&)> setup);
  // Runs the deferred setup now, if it has not run.
  void run_setup();
  bool setup_pending() const { return setup_pending_.load(std::memory_order_acquire); }

  Block* malloc(int device, std::size_t size, StreamId stream, std::size_t at_least = 0) {
    return this->device(device).malloc(size, stream, at_least);
  }
  // What a block from malloc() is for its caller: freed, used on another stream, where it lives.
  static void free(Block* block) { block->segment->owner->free(block); }
  static void record_stream(Block* block, StreamId stream) { block->segment->owner->record_stream(block, stream); }
  static int device_of(const Block* block) { return block->segment->owner->device(); }
  static PoolId pool_of(const Block* block) { return block->segment->pool->id(); }
  static const DeviceAllocator* allocator_of(const Block* block) { return block->segment->owner; }
  // Whether handing out `block` split the block that headed its segment (DeviceAllocator::heads_a_split).
  static bool heads_a_split(const Block* block) { return block->segment->owner->heads_a_split(block); }

  // By address. raw_free of an address raw_alloc did not return throws std::invalid_argument.
  void* raw_alloc(int device, std::size_t size, StreamId stream, std::size_t at_least = 0) {
    Block* block = malloc(device, size, stream, at_least);
    Shard& s = shard(block->ptr());
    try {
      std::lock_guard<Lock> lock(s.lock);
      s.blocks.insert(block);  // may grow the table, which may fail: then the block goes back
    } catch (...) {
      free(block);
      throw;
    }
    return block->ptr();
  }
  void raw_free(void* ptr);
  Block* find_raw(void* ptr) const;
  // `stream` also uses the memory at `ptr`, from raw_alloc; false (nothing changes) if raw_alloc
  // did not return it.
  bool raw_record_stream(void* ptr, StreamId stream);
  // Takes `ptr` out of the raw table and returns its block (still allocated), or nullptr.
  Block* take_raw(void* ptr) {
    Shard& s = shard(ptr);
    std::lock_guard<Lock> lock(s.lock);
    return s.blocks.take(reinterpret_cast<std::uintptr_t>(ptr));
  }

 private:
  static constexpr std::size_t kShards = 16;
  struct alignas(64) Shard {
    mutable Lock lock;
    AddressTable blocks;
  };
  Shard& shard(const void* ptr) const {
    return shards_[(reinterpret_cast<std::uintptr_t>(ptr) >> 9) % kShards];
  }
  void check_index(int index) const;
  int count_devices() const;
  DeviceAllocator& make_device(int index);

  Backend& backend_;
  const AllocatorConfig defaults_;
  // Sized when the devices are counted; count_ is -1 until then.
  mutable std::once_flag counted_;
  mutable std::atomic<int> count_{-1};
  mutable std::mutex create_mutex_;  // guards configs_, devices_, pressure_shares_
  mutable std::vector<AllocatorConfig> configs_;
  std::vector<double> pressure_shares_;  // by watch slot
  mutable std::vector<std::unique_ptr<DeviceAllocator>> devices_;
  mutable std::vector<std::atomic<DeviceAllocator*>> ready_;
  // The deferred setup. Recursive: the setup itself configures devices, which would run it.
  std::recursive_mutex setup_mutex_;
  std::function<void(CachingAllocator&)> setup_;
  bool setup_running_ = false;
  std::atomic<bool> setup_pending_{false};
  mutable std::array<Shard, kShards> shards_;
};

}  // namespace gpumem
