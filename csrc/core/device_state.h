// What the parts of one device's allocator share: the backend, the accounts (the cap and the
// statistics: core/accounts.h), the segments by address, the default pool and the private pools, the lanes (whose arenas are the
// Blocks' homes). The fallback chain (core/device_core.h), the two sources of new memory
// (core/plain_segments.h, core/growable_segments.h) and the releases (core/release.h) work on it,
// all under the device's lock: nothing here locks. Each member is a type that keeps its own
// invariants, or a fact of the device set once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "core/accounts.h"
#include "core/backend.h"
#include "core/block.h"
#include "core/departures.h"
#include "core/lane_ledgers.h"
#include "core/lanes.h"
#include "core/pool.h"
#include "core/private_pools.h"
#include "core/segment_source.h"
#include "core/segment_table.h"
#include "core/stats.h"

namespace gpumem {

class DeviceAllocator;
class ShareHooks;

// One malloc as the fallback chain carries it: the pool it goes to, its pool class, its stream,
// the bytes its block must hold, and whether the device refused new memory for it (which makes
// an out-of-memory error "device full").
struct Request {
  Pool* pool;
  bool small;
  StreamId stream;
  std::size_t size;
  bool device_refused = false;
};

struct DeviceState {
  DeviceState(Backend& backend, int device, DeviceAllocator* owner);
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  Backend& backend;
  const int device;
  DeviceAllocator* const owner;  // what Segment::owner names
  BackendSource backend_source;  // the default pool's source, and of pools without one
  Accounts accounts;  // the cap and the statistics: the only way to change reserved (core/accounts.h)
  mutable DeviceLock lanes;  // the device's locks, and the arenas of the Blocks (core/lanes.h)
  LaneLedgers lane_ledgers;  // when `stats` takes in the lanes' own (core/lane_ledgers.h)
  Pool default_pool;
  PrivatePools pools;
  SegmentTable segments;  // by address: the owner of every Segment (core/segment_table.h)
  Departures departing;  // plain segments empty_cache is giving back outside the lock (core/departures.h)

  // Asks the backend for the device's memory, once. DeviceCore asks only when the config is known
  // to be sane: a bad release threshold is refused before the backend hears of the device.
  void ask_device_total() { device_total_ = backend.total_memory(device); }
  std::size_t device_total() const { return device_total_; }

  // A pool target is active: a graph may be capturing, so nothing waits on events, synchronizes or
  // unmaps.
  bool capturing() const { return pools.capturing(); }
  SegmentSource& source_of(const Pool& pool) { return pool.source() ? *pool.source() : backend_source; }
  // The default pool's cache, a region's, and a private pool's once nobody holds it, may go back;
  // nothing of a paused region (core/pause.cpp).
  bool releasable_pool(const Pool& pool) const {
    return &pool == &default_pool || (pool.region() ? !pool.paused() : pool.use_count() == 0);
  }

  // Where the blocks of `stream` come from and go back to, on every path.
  BlockArena& arena_for(StreamId stream) { return lanes.arena_for(stream); }

  // Files a segment of [addr, addr + size) under the pool, as one block, its head from its
  // stream's arena: a plain segment for `chunk` 0, else an unmapped growable one mapped in chunks
  // of that size. Statistics are the caller's.
  Segment* add_segment(Pool& pool, bool small, StreamId stream, std::uintptr_t addr, std::size_t size,
                       std::size_t chunk) {
    return segments.add(pool, source_of(pool), arena_for(stream), small, stream, addr, size, chunk);
  }
  // Forgets a segment whose memory went back. Statistics are the caller's.
  void erase_segment(Segment* segment) { segments.erase(segment, arena_for(segment->stream)); }

 private:
  std::size_t device_total_ = 0;
};

}  // namespace gpumem
