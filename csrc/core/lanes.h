// The device allocator's locks: one lane per stream for the cached path, and the whole device for
// everything else.
//
// Design note. Blocks never cross streams: a segment belongs to one stream, its blocks are split
// and merged only with each other, and a stream's free blocks are bins of their own in the free
// set (core/free_set.h). So a cached malloc or free on one stream touches nothing that another
// stream's cached path touches, except the statistics. Each stream therefore gets a lane: a lock,
// a Block arena, and a share of the statistics (LaneStats, core/stats.h). The cached path
// (DeviceAllocator::malloc_in_lane, free_in_lane) takes only its stream's lane and writes nothing
// shared, so threads on different streams do not wait for each other, nor move each other's cache
// lines.
//
// The statistics stay exact, peaks included. A lane changes the figures in its own share; the
// whole device folds every share into the ledger when it is taken (DeviceLock::lock), so whatever
// runs under it reads exact figures, the cap's allocated bytes among them. And a lane may raise a
// figure only within the room the ledger granted it when the whole device was last let go: a
// lane-count-th of the distance to that figure's peak (StatLedger::room). So the lanes together can
// never pass a peak on their own; an increase that does not fit goes to the whole device instead,
// where the ledger moves the peak exactly. Decreases always fit, and give the lane room back.
//
// Everything else (new memory, releases, events, snapshots, settings, checkpoint state) takes the
// whole device: DeviceLock::lock() takes the device's lock and then every lane, in order, so it
// runs alone, exactly as under one lock per device. What the cached path reads to decide that it
// may run (a capture, pending events, the limit and the release threshold) changes only under the
// whole device, so it is stable while a lane is held. Lock order: the device, then the lanes in
// index order; a lane holder takes nothing more.
//
// Streams get slots in the order they first allocate, up to kSlots; slot i uses lane i % kLanes,
// so the first kLanes streams never share a lane. A stream without a slot (more than kSlots
// streams) always takes the whole device: correct, only slower. Slots are never reused: a slot's
// stream is written once, before the count that publishes it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/block.h"
#include "core/block_arena.h"
#include "core/lock.h"
#include "core/stats.h"

namespace gpumem {

// One stream's share of the cached path: its lock and its spare blocks.
struct alignas(64) Lane {
  Lock lock;
  BlockArena arena;
  LaneStats stats;  // its changes to the statistics since the whole device last held it
  std::uint64_t served = 0;  // mallocs and frees its cached path served
  bool busy = false;         // its cached path ran, or wanted room, since the last grant
};

// A stream with a lane, and the default pool's free bins of that stream, found once (they live as
// long as the pool). Written under the lane's lock.
struct alignas(64) LaneSlot {
  StreamId stream = 0;
  FreeBins* bins[2] = {nullptr, nullptr};  // small, large
};

class DeviceLock {
 public:
  static constexpr int kLanes = 8;
  static constexpr int kSlots = 32;

  DeviceLock() = default;
  DeviceLock(const DeviceLock&) = delete;
  DeviceLock& operator=(const DeviceLock&) = delete;

  // The statistics the lanes' changes belong to; set once, before any lock().
  void attach(StatLedger* ledger) { ledger_ = ledger; }

  // The whole device: for std::lock_guard. Taking it folds the lanes' statistics into the ledger,
  // so that what runs under it reads and changes exact figures; letting it go grants the lanes
  // their room again.
  void lock() {
    device_.lock();
    for (Lane& lane : lanes_) lane.lock.lock();
    fold();
  }
  void unlock() {
    fold();  // a lane's cached path may have run under the whole device (LaneGuard, checker builds)
    grant();
    for (int i = kLanes - 1; i >= 0; --i) lanes_[i].lock.unlock();
    device_.unlock();
  }
  // Under the whole device: the lanes' changes into the ledger (for the invariant checker).
  void fold() {
    for (Lane& lane : lanes_) ledger_->fold(lane.stats);
  }

  // The slot of `stream`, or -1 if it has none. Takes no lock.
  int slot_of(StreamId stream) const {
    const int count = count_.load(std::memory_order_acquire);
    for (int i = 0; i < count; ++i) {
      if (slots_[i].stream == stream) return i;
    }
    return -1;
  }
  // Gives `stream` a slot if it has none and one is left. Only under lock().
  void add_stream(StreamId stream) {
    const int count = count_.load(std::memory_order_relaxed);
    if (count == kSlots || slot_of(stream) >= 0) return;
    slots_[count].stream = stream;
    count_.store(count + 1, std::memory_order_release);
  }
  Lane& lane_of_slot(int slot) { return lanes_[slot % kLanes]; }
  // Under the whole device: the mallocs and frees the lanes' cached paths served so far.
  std::uint64_t served() const {
    std::uint64_t total = 0;
    for (const Lane& lane : lanes_) total += lane.served;
    return total;
  }
  LaneSlot& slot(int slot) { return slots_[slot]; }

 private:
  // The lanes that were busy since the last grant share the room below each peak equally; the
  // others get none until they ask (a lane that wants room it lacks goes to the whole device once,
  // and is busy at the next grant). If none was busy, every lane with a stream shares it.
  void grant() {
    const int used = std::min(count_.load(std::memory_order_relaxed), kLanes);
    if (used == 0) return;
    int busy = 0;
    for (int i = 0; i < used; ++i) busy += lanes_[i].busy ? 1 : 0;
    std::int64_t room[LaneStats::kFigures][3];
    ledger_->room(busy > 0 ? busy : used, room);
    for (int i = 0; i < used; ++i) {
      Lane& lane = lanes_[i];
      if (busy == 0 || lane.busy) {
        std::memcpy(lane.stats.room, room, sizeof room);
      } else {
        std::memset(lane.stats.room, 0, sizeof lane.stats.room);
      }
      lane.busy = false;
    }
  }

  StatLedger* ledger_ = nullptr;
  Lock device_;
  Lane lanes_[kLanes];
  LaneSlot slots_[kSlots];
  std::atomic<int> count_{0};
};

// Holds one lane for the cached path. In builds with the invariant checker (GPUMEM_CHECK_INVARIANTS)
// it holds the whole device instead: the checker reads every segment after each operation, which
// is only sound while nothing else runs.
class LaneGuard {
 public:
  LaneGuard(DeviceLock& device, int slot) : device_(device), lane_(device.lane_of_slot(slot)) {
#if GPUMEM_CHECK_INVARIANTS
    device_.lock();
#else
    lane_.lock.lock();
#endif
  }
  ~LaneGuard() {
#if GPUMEM_CHECK_INVARIANTS
    device_.unlock();
#else
    lane_.lock.unlock();
#endif
  }
  LaneGuard(const LaneGuard&) = delete;
  LaneGuard& operator=(const LaneGuard&) = delete;
  Lane& lane() { return lane_; }

 private:
  DeviceLock& device_;
  Lane& lane_;
};

}  // namespace gpumem
