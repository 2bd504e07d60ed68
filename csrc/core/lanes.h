// The device allocator's locks: one lane per stream for the cached path, and the whole device for
// everything else.
//
// Design note. Blocks never cross streams: a segment belongs to one stream, its blocks are split
// and merged only with each other, and a stream's free blocks are bins of their own in the free
// set (core/free_set.h). So a cached malloc or free on one stream touches nothing that another
// stream's cached path touches, except the statistics. Each stream therefore gets a lane: a lock
// and a Block arena. The cached path (DeviceCore::malloc_in_lane, free_in_lane) takes only its
// stream's lane, so threads on different streams do not wait for each other's splits and merges.
//
// The statistics' events of the cached path go to the lane's own StatLedger, which the device's
// ledger takes in whenever the whole device is taken (core/lane_ledgers.h): one kind of ledger,
// one set of rules, and no statistic that two lanes write.
//
// Blocks have one home: the arena of their stream's lane, or the device's arena for a stream
// without a lane (arena_for). A block's stream never changes, so whichever path makes or recycles a
// block, the cached path under the lane or any path under the whole device, uses the same arena:
// none fills while another empties.
//
// Everything else (new memory, releases, events, snapshots, settings, checkpoint state) takes the
// whole device: lock() takes the device's lock and then every lane, in order, so it runs alone,
// exactly as under one lock per device. Its owner says, when it lets the whole device go, whether
// each lane's cached malloc and free may run (unlock(LaneGates)): what decides that changes only
// under the whole device, so it is stable while a lane is held. Lock order: the device, then the
// lanes in index order; a lane holder may only try another lane's lock (core/lane_ledgers.h).
//
// Streams get slots in the order they first allocate, up to kSlots; slot i uses lane i % kLanes,
// so the first kLanes streams never share a lane. A stream without a slot (more than kSlots
// streams) always takes the whole device: correct, only slower. Slots are never reused: a slot's
// stream is written once, before the count that publishes it, and a stream gets its slot before
// its first block is made (DeviceCore::malloc_on_device), so its blocks' arena never changes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/block.h"
#include "core/block_arena.h"
#include "core/lock.h"
#include "core/stats.h"

namespace gpumem {

// One stream's share of the cached path: its lock, whether the cached path may run, the arena
// of its blocks, and the statistics its cached calls changed (core/lane_ledgers.h).
struct alignas(128) Lane {
  Lock lock;
  // Set whenever the whole device is let go (DeviceLock::unlock): whether a cached malloc, and a
  // cached free, may run in the lane now (LaneGates).
  bool malloc_open = false;
  bool free_open = false;
  int index = 0;
  BlockArena arena;
  StatLedger stats;
};

// A stream with a lane, its lane, and the default pool's free bins of that stream, found once
// (they live as long as the pool). Written under the lane's lock.
struct alignas(64) LaneSlot {
  StreamId stream = 0;
  Lane* lane = nullptr;
  FreeBins* bins[2] = {nullptr, nullptr};  // small, large
};

// What the owner of the lanes says, each time it lets the whole device go, about its state then.
struct LaneGates {
  bool malloc_open;  // a cached malloc may run in a lane
  bool free_open;    // a cached free may
};

class DeviceLock {
 public:
  static constexpr int kLanes = 8;
  static constexpr int kSlots = 32;

  DeviceLock() {
    for (int i = 0; i < kLanes; ++i) lanes_[i].index = i;
    for (int i = 0; i < kSlots; ++i) slots_[i].lane = &lanes_[i % kLanes];
  }
  static_assert(kLanes <= StatLedger::kMaxParts, "the device's ledger takes in every lane's at once");
  DeviceLock(const DeviceLock&) = delete;
  DeviceLock& operator=(const DeviceLock&) = delete;

  // The whole device. Until the first unlock every lane is closed.
  void lock() {
    device_.lock();
    for (Lane& lane : lanes_) lane.lock.lock();
  }
  void unlock(LaneGates gates) {
    for (Lane& lane : lanes_) {
      lane.malloc_open = gates.malloc_open;
      lane.free_open = gates.free_open;
    }
    for (int i = kLanes - 1; i >= 0; --i) lanes_[i].lock.unlock();
    device_.unlock();
  }
  Lane& lane(int index) { return lanes_[index]; }

  // The slot of `stream`, or nullptr if it has none. Takes no lock.
  LaneSlot* slot_of(StreamId stream) {
    LaneSlot* const end = slots_ + count_.load(std::memory_order_acquire);
    for (LaneSlot* slot = slots_; slot != end; ++slot) {
      if (slot->stream == stream) return slot;
    }
    return nullptr;
  }
  const LaneSlot* slot_of(StreamId stream) const { return const_cast<DeviceLock*>(this)->slot_of(stream); }
  // Gives `stream` a slot if it has none and one is left. Only under lock().
  void add_stream(StreamId stream) {
    const int count = count_.load(std::memory_order_relaxed);
    if (count == kSlots || slot_of(stream)) return;
    slots_[count].stream = stream;
    count_.store(count + 1, std::memory_order_release);
  }
  // The home of the blocks of `stream`: its lane's arena, or the device's. Under the whole device,
  // or under the stream's lane.
  BlockArena& arena_for(StreamId stream) {
    LaneSlot* slot = slot_of(stream);
    return slot ? slot->lane->arena : device_arena_;
  }
  // Every arena, the device's first: for the invariant checker, under the whole device.
  template <typename F>
  void for_each_arena(F f) const {
    f(device_arena_, -1);
    for (int i = 0; i < kLanes; ++i) f(lanes_[i].arena, i);
  }
  // The lane index of `stream`'s slot, or -1 (the device's arena).
  int lane_index_of(StreamId stream) const {
    const LaneSlot* slot = slot_of(stream);
    return slot ? static_cast<int>(slot->lane - lanes_) : -1;
  }

 private:
  Lock device_;
  Lane lanes_[kLanes];
  LaneSlot slots_[kSlots];
  std::atomic<int> count_{0};
  BlockArena device_arena_;  // the blocks of streams without a lane
};

// Holds one lane for the cached path.
class LaneGuard {
 public:
  explicit LaneGuard(Lane& lane) : lane_(lane) { lane_.lock.lock(); }
  ~LaneGuard() { lane_.lock.unlock(); }
  LaneGuard(const LaneGuard&) = delete;
  LaneGuard& operator=(const LaneGuard&) = delete;
  Lane& lane() { return lane_; }

 private:
  Lane& lane_;
};

}  // namespace gpumem
