// What one device reports of itself, as values: a snapshot's segments and blocks, the work counts,
// the settings in effect; and a private pool's options. DeviceCore makes them (core/device_views.cpp),
// the facade (core/device_allocator.h) hands them out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "core/pool.h"
#include "core/process_scope.h"

namespace gpumem {

// A read-only picture of the device's memory, for snapshots and reports.
struct BlockInfo {
  std::uintptr_t addr;
  std::size_t size;
  std::size_t requested;
  enum State { kFree, kAllocated, kPendingFree } state;
};
struct SegmentInfo {
  std::uintptr_t addr;
  std::size_t size;
  StreamId stream;
  PoolId pool;
  bool small;
  bool growable;  // a mapped stretch of a growable segment: one SegmentInfo per stretch
  std::vector<BlockInfo> blocks;
  bool paused = false;  // a paused region's (core/pause.cpp): no memory behind it until resumed
};

// An allocated block as another process would map it (CUDA IPC): the block, and what memory stands
// behind it. A plain segment is one allocation, shared whole (`memory` is the segment); a growable
// segment's memory is its chunks, one physical allocation each, and those the block lies on are
// shared (`memory` lists them in address order, tiling [memory.front().first, end)).
struct ShareRange {
  std::uintptr_t block_addr = 0;
  std::size_t block_size = 0;
  bool growable = false;
  std::vector<std::pair<std::uintptr_t, std::size_t>> memory;  // start -> bytes
};

// How the work went, for tests and benchmarks: the mallocs and frees that took the whole device
// (every other call was served by its stream's lane alone); every Block the arenas made, spare or
// in segments, the host memory the block lists hold (flat while the blocks in use are: every Block
// keeps its home, core/lanes.h); the blocks growable segments' unmapping walks looked at
// (GrowableSegments::blocks_visited).
struct WorkCounts {
  std::uint64_t on_device = 0;
  std::size_t blocks_made = 0;
  std::uint64_t growable_blocks_visited = 0;
  std::size_t growable_moved = 0;      // bytes unmapped, ever, to make room at the high mark
  std::size_t growable_allowance = 0;  // bytes a growth may pass the high mark by now (GrowableSegments)
};

struct DeviceSettings {
  LimitScope scope = LimitScope::kAllocator;
  double release_threshold = 0.0;
  bool growable = false;
  std::size_t chunk = 0;  // GrowableSegments::large_chunk()
};

}  // namespace gpumem
