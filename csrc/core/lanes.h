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

// One stream's share of the cached path: its lock, whether the cached path may run, its spare
// blocks and its share of the statistics.
struct alignas(128) Lane {
  Lock lock;
  // Set whenever the whole device is let go (DeviceLock::unlock), from what only the whole device
  // changes: whether a cached malloc, and a cached free, may run in the lane now (LaneGates).
  bool malloc_open = false;
  bool free_open = false;
  bool wanted = false;       // its cached path wanted room it lacked since the last grant
  BlockArena arena;
  LaneStats stats;           // its changes to the statistics since the whole device last held it
  std::uint64_t served = 0;  // mallocs and frees its cached path served
  std::uint64_t served_at_grant = 0;  // `served` at the last grant: it was busy since if they differ
};

// A stream with a lane, its lane, and the default pool's free bins of that stream, found once
// (they live as long as the pool). Written under the lane's lock.
struct alignas(64) LaneSlot {
  StreamId stream = 0;
  Lane* lane = nullptr;
  FreeBins* bins[2] = {nullptr, nullptr};  // small, large
};

// What the owner of the lanes says, each time the whole device is let go, about its state then.
struct LaneGates {
  bool malloc_open;  // a cached malloc may run in a lane: no capture, no block pending on a stream
  bool free_open;    // a cached free may: no capture, no release threshold, reserved within the budget
};

class DeviceLock {
 public:
  static constexpr int kLanes = 8;
  static constexpr int kSlots = 32;

  DeviceLock() {
    for (int i = 0; i < kSlots; ++i) slots_[i].lane = &lanes_[i % kLanes];
  }
  DeviceLock(const DeviceLock&) = delete;
  DeviceLock& operator=(const DeviceLock&) = delete;

  // The statistics the lanes' changes belong to, and what says whether the cached path may run
  // (called with `owner` whenever the whole device is let go); set once, before any lock(). Until
  // the first unlock() every lane is closed.
  void attach(StatLedger* ledger, LaneGates (*gates)(const void* owner), const void* owner) {
    ledger_ = ledger;
    gates_ = gates;
    owner_ = owner;
  }

  // The whole device: for std::lock_guard. Taking it folds the lanes' statistics into the ledger,
  // so that what runs under it reads and changes exact figures; letting it go opens or closes the
  // lanes' cached paths and grants the lanes their room again.
  void lock() {
    device_.lock();
    for (Lane& lane : lanes_) lane.lock.lock();
    fold();
  }
  void unlock() {
    grant();
    for (int i = kLanes - 1; i >= 0; --i) lanes_[i].lock.unlock();
    device_.unlock();
  }
  // Under the whole device: the lanes' changes into the ledger. Only a lane that served a call since
  // the last grant can have any: its statistics change only on a call it serves (the cached path
  // counts the call before it changes them, and changes nothing on a call it gives up). Folding a
  // lane again before the next grant adds nothing: a fold leaves no change behind.
  void fold() {
    for (Lane& lane : lanes_) {
      if (served_since_grant(lane)) ledger_->fold(lane.stats);
    }
  }

  // The slot of `stream`, or nullptr if it has none. Takes no lock.
  LaneSlot* slot_of(StreamId stream) {
    LaneSlot* const end = slots_ + count_.load(std::memory_order_acquire);
    for (LaneSlot* slot = slots_; slot != end; ++slot) {
      if (slot->stream == stream) return slot;
    }
    return nullptr;
  }
  // Gives `stream` a slot if it has none and one is left. Only under lock().
  void add_stream(StreamId stream) {
    const int count = count_.load(std::memory_order_relaxed);
    if (count == kSlots || slot_of(stream)) return;
    slots_[count].stream = stream;
    count_.store(count + 1, std::memory_order_release);
  }
  // Under the whole device: the mallocs and frees the lanes' cached paths served so far.
  std::uint64_t served() const {
    std::uint64_t total = 0;
    for (const Lane& lane : lanes_) total += lane.served;
    return total;
  }

 private:
  // Opens or closes every lane's cached path, and shares the room below each peak: the lanes that
  // were busy since the last grant share it equally; the others get none until they ask (a lane
  // that wants room it lacks goes to the whole device once, and is busy at the next grant). If
  // none was busy, every lane with a stream shares it.
  void grant() {
    const LaneGates gates = gates_(owner_);
    const int used = std::min(count_.load(std::memory_order_relaxed), kLanes);
    for (int i = 0; i < used; ++i) {
      lanes_[i].malloc_open = gates.malloc_open;
      lanes_[i].free_open = gates.free_open;
    }
    if (used == 0) return;
    int busy = 0;
    for (int i = 0; i < used; ++i) busy += is_busy(lanes_[i]) ? 1 : 0;
    std::int64_t room[LaneStats::kFigures][3];
    ledger_->room(busy > 0 ? busy : used, room);
    for (int i = 0; i < used; ++i) {
      Lane& lane = lanes_[i];
      if (busy == 0 || is_busy(lane)) {
        lane.stats.grant(room);
      } else {
        lane.stats.grant(kNoRoom);
      }
      lane.wanted = false;
      lane.served_at_grant = lane.served;
    }
  }
  static bool served_since_grant(const Lane& lane) { return lane.served != lane.served_at_grant; }
  static bool is_busy(const Lane& lane) { return lane.wanted || served_since_grant(lane); }

  static constexpr std::int64_t kNoRoom[LaneStats::kFigures][3] = {};

  StatLedger* ledger_ = nullptr;
  LaneGates (*gates_)(const void*) = nullptr;
  const void* owner_ = nullptr;
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
#if GPUMEM_CHECK_INVARIANTS
  LaneGuard(DeviceLock& device, Lane& lane) : device_(device), lane_(lane) { device_.lock(); }
  ~LaneGuard() { device_.unlock(); }
#else
  LaneGuard(DeviceLock&, Lane& lane) : lane_(lane) { lane_.lock.lock(); }
  ~LaneGuard() { lane_.lock.unlock(); }
#endif
  LaneGuard(const LaneGuard&) = delete;
  LaneGuard& operator=(const LaneGuard&) = delete;
  Lane& lane() { return lane_; }

 private:
#if GPUMEM_CHECK_INVARIANTS
  DeviceLock& device_;
#endif
  Lane& lane_;
};

}  // namespace gpumem
