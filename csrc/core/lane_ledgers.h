// The statistics the lanes' cached paths write (core/lanes.h), and when the device's ledger takes
// them in.
//
// Design note. A lane's cached malloc or free writes its events into its lane's own StatLedger,
// under the lane's lock only: no line of it is written by another thread, so threads on their own
// streams share no statistic (one shared ledger behind a lock cost two threads on one device 4.6
// times one thread's time per pair: the lock's and the ledger's cache lines moved between cores
// on every call). The device's ledger takes in every lane's changes whenever the whole device is
// taken (DeviceCore::WholeDevice), before anything there reads or writes a figure: so under the
// whole device every current and accumulated figure is exact, and so is whatever decides from
// them (the cap's checks, the releases, a snapshot, a reset).
//
// Peaks. A lane's ledger knows the order of its own events, not how they interleaved with another
// lane's; so its peaks are exact while at most one lane has changes not yet taken in, and that is
// what the writer below keeps wherever it can. `writer_` names the one lane that may have changes
// (kNone: none has), or kMany. A lane that finds another lane named takes that lane's changes in
// first, if that lane is idle (its lock free): calls on several streams from one thread, or from
// threads that take turns, keep every peak exact, at the cost of one uncontended lock and one
// take_in per change of lane. If that lane is busy (two threads in their lanes at once), the
// writer becomes kMany until the whole device next runs: the peaks taken in then are the highest
// the whole could have reached, the figures when the whole device last ran plus each lane's highest
// rise since, as if those had coincided. So while threads on different lanes run at once, a peak
// may be above the true one, never below it, by at most what the other lanes rose; it is exact
// again from the next call that takes the whole device (reading the statistics is one). Currents
// and accumulated figures are exact throughout.
//
// Lock order: a lane holder only try-locks another lane, so it never waits on one.
#pragma once

#include <atomic>

#include "core/lanes.h"
#include "core/stats.h"

namespace gpumem {

class LaneLedgers {
 public:
  // Under `lane`'s lock, before the events of one cached call: the ledger they go to.
  StatLedger& enter(DeviceLock& lanes, Lane& lane, StatLedger& device) {
    const int writer = writer_.load(std::memory_order_acquire);
    if (writer != lane.index && writer != kMany) enter_contended(lanes, lane, device, writer);
    return lane.stats;
  }
  // Under the whole device: the device's ledger takes in every lane's changes.
  void take_in(DeviceLock& lanes, StatLedger& device);

 private:
  static constexpr int kNone = -1;
  static constexpr int kMany = -2;
  void enter_contended(DeviceLock& lanes, Lane& lane, StatLedger& device, int writer);

  alignas(64) std::atomic<int> writer_{kNone};
};

}  // namespace gpumem
