// All devices of one backend: one DeviceAllocator each, created on first use, and a table of raw
// pointers for callers that free by address (the CUDAAllocator's raw_alloc / raw_delete).
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/device_allocator.h"

namespace gpumem {

class CachingAllocator {
 public:
  CachingAllocator(Backend& backend, AllocatorConfig defaults = {});

  int device_count() const { return static_cast<int>(devices_.size()); }
  // Throws DeviceError naming the index and the devices there are.
  DeviceAllocator& device(int index);
  // The device's allocator if it was created; nullptr otherwise (nothing allocated there yet).
  DeviceAllocator* existing(int index) const;
  // Settings for a device: applied now if its allocator exists, else when it is created.
  void configure(int index, const AllocatorConfig& config);

  Block* malloc(int device, std::size_t size, StreamId stream, std::size_t at_least = 0) {
    return this->device(device).malloc(size, stream, at_least);
  }
  static void free(Block* block) { block->segment->owner->free(block); }

  // By address. raw_free of an address raw_alloc did not return throws std::invalid_argument.
  void* raw_alloc(int device, std::size_t size, StreamId stream, std::size_t at_least = 0);
  void raw_free(void* ptr);
  Block* find_raw(void* ptr) const;
  // Takes `ptr` out of the raw table and returns its block (still allocated), or nullptr.
  Block* take_raw(void* ptr);

 private:
  static constexpr std::size_t kShards = 16;
  struct Shard {
    mutable std::mutex mutex;
    std::unordered_map<void*, Block*> blocks;
  };
  Shard& shard(const void* ptr) const {
    return shards_[(reinterpret_cast<std::uintptr_t>(ptr) >> 9) % kShards];
  }
  void check_index(int index) const;

  Backend& backend_;
  mutable std::mutex create_mutex_;
  std::vector<AllocatorConfig> configs_;
  std::vector<std::unique_ptr<DeviceAllocator>> devices_;
  std::vector<std::atomic<DeviceAllocator*>> ready_;
  mutable std::array<Shard, kShards> shards_;
};

}  // namespace gpumem
