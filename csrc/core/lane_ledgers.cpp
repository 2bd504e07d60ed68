// When the device's ledger takes in the lanes' (core/lane_ledgers.h).
#include "core/lane_ledgers.h"

namespace gpumem {

void LaneLedgers::enter_contended(DeviceLock& lanes, Lane& lane, StatLedger& device, int writer) {
  for (;;) {
    if (writer == lane.index || writer == kMany) return;
    if (writer == kNone) {
      // No lane has changes: this one becomes the writer, unless another lane did first.
      if (writer_.compare_exchange_weak(writer, lane.index, std::memory_order_acq_rel, std::memory_order_acquire)) return;
      continue;
    }
    Lane& other = lanes.lane(writer);
    if (!other.lock.try_lock()) {
      // Another thread is in that lane now: several lanes change at once. Naming kMany claims
      // nothing, so it may overwrite whatever another lane wrote meanwhile (kNone is written only
      // under the whole device, which cannot run while this lane is held).
      writer_.store(kMany, std::memory_order_release);
      return;
    }
    // Holding the writer's lane, nobody else can take its changes in, or write it; it is still
    // the writer unless another lane named kMany meanwhile.
    int still = writer_.load(std::memory_order_acquire);
    if (still == writer) {
      StatLedger* changes = &other.stats;
      device.take_in(&changes, 1);
      still = writer;
      writer_.compare_exchange_strong(still, lane.index, std::memory_order_acq_rel, std::memory_order_acquire);
      other.lock.unlock();
      return;
    }
    other.lock.unlock();
    writer = still;
  }
}

void LaneLedgers::take_in(DeviceLock& lanes, StatLedger& device) {
  const int writer = writer_.load(std::memory_order_relaxed);
  if (writer == kNone) return;
  if (writer == kMany) {
    StatLedger* changes[DeviceLock::kLanes];
    for (int i = 0; i < DeviceLock::kLanes; ++i) changes[i] = &lanes.lane(i).stats;
    device.take_in(changes, DeviceLock::kLanes);
  } else {
    StatLedger* changes = &lanes.lane(writer).stats;
    device.take_in(&changes, 1);
  }
  writer_.store(kNone, std::memory_order_relaxed);
}

}  // namespace gpumem
