// The blocks of private pools (CUDA graphs, MemPools) that allocate() handed out, by address.
//
// Default-pool blocks are never entered: their DataPtr carries the Block*, so freeing needs no
// lookup, and the hot path stays free of maps. Private-pool blocks are entered because torch names
// them by address alone: their DataPtrs carry the address (a checkpoint restore replaces the Block
// behind an address while tensors made before it live on), raw_delete of a pointer whose DataPtr
// torch released (cudagraph trees do this), and the restore itself, which frees every allocated
// block of a pool.
// One mutex per device; a block is entered after the core's malloc returns and removed before
// the core's free, so the core's device lock is never held while this one is taken.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/block.h"

namespace gpumem {

class PoolBlocks {
 public:
  using Map = std::unordered_map<std::uintptr_t, Block*>;

  // Room for `devices` devices; the lookups by address search those that ever had a block.
  explicit PoolBlocks(int devices) : devices_(devices) {}

  void add(int device, Block* block) {
    Device& d = devices_[device];
    for (int used = used_.load(); used <= device && !used_.compare_exchange_weak(used, device + 1);) {
    }
    std::lock_guard<std::mutex> lock(d.mutex);
    d.blocks.emplace(block->addr, block);
  }
  void remove(int device, const Block* block) {
    Device& d = devices_[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    d.blocks.erase(block->addr);
  }
  // The block at `addr`, or nullptr.
  Block* find(int device, std::uintptr_t addr) {
    Device& d = devices_[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.blocks.find(addr);
    return it == d.blocks.end() ? nullptr : it->second;
  }
  // Removes and returns the block at `addr`, or nullptr: the one step a free by address needs, so
  // a restore cannot run between the lookup and the removal.
  Block* take(int device, std::uintptr_t addr) {
    Device& d = devices_[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.blocks.find(addr);
    if (it == d.blocks.end()) return nullptr;
    Block* block = it->second;
    d.blocks.erase(it);
    return block;
  }
  // The same on whichever device has the block: torch names some blocks by address alone, and
  // device addresses are unique across devices.
  Block* find_any(std::uintptr_t addr) {
    Block* block = nullptr;
    for (int d = 0; !block && d < device_count(); ++d) block = find(d, addr);
    return block;
  }
  Block* take_any(std::uintptr_t addr) {
    Block* block = nullptr;
    for (int d = 0; !block && d < device_count(); ++d) block = take(d, addr);
    return block;
  }
  // Runs f(map) with the device's map locked: a multi-step change (the checkpoint restore) that
  // must not interleave with frees of the same pool.
  template <class F>
  decltype(auto) locked(int device, F&& f) {
    Device& d = devices_[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    return f(d.blocks);
  }
  int device_count() const { return used_.load(); }

 private:
  struct Device {
    std::mutex mutex;
    Map blocks;
  };
  std::vector<Device> devices_;
  std::atomic<int> used_{0};  // 1 + the highest device a block was ever added on
};

}  // namespace gpumem
