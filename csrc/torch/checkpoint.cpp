// Checkpoints of a private pool, for torch.compile's cudagraph trees (mode="reduce-overhead").
//
// The trees record every CUDA graph into one pool. After each recording they save the pool's
// state (getCheckpointState); before recording on a new branch they ask for the pool to be put
// back as it was then (setCheckpointPoolState): exactly the blocks allocated at the checkpoint,
// at the same addresses, everything else free. The answer lists the addresses freed and a DataPtr
// for each block allocated, which torch attaches to the tensors still alive.
//
// The state is the pool's layout from the core's snapshot. The restore uses only the core's
// public operations, in three steps:
//   1. check, before changing anything, that it can succeed: each segment of the checkpoint is
//      still in the pool with the same size, and each allocated block of the pool is one gpumem
//      can free by address (a PoolBlocks entry or a raw allocation) with no other stream using it;
//   2. free every allocated block of the pool, so each of its segments becomes one free block;
//   3. cut every segment of the pool again into its checkpoint layout (a segment the checkpoint
//      does not know stays whole) by mallocs routed to the pool, then free the tiles that stand
//      for free blocks.
// Why step 3 lands each tile where it must: segments are cut one at a time, smallest first (ties
// by address), and a malloc takes the front of the block best fit gives it. The uncut rest of the
// current segment is then the smallest free block large enough on its stream and size class: the
// segments cut before are all taken, the ones after are at least as large as this whole segment.
// Tiles of small segments are at most 1 MiB (larger ones would be served from the large pool);
// blocks of large segments are all over 1 MiB, so every cut is one the core makes anyway.
// Each tile is checked as it lands and the final layout against the checkpoint.
#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

#include "core/sizing.h"
#include "torch/allocator.h"
#include "torch/error_bridge.h"

namespace gpumem {

namespace {

struct PoolCheckpoint final : c10::cuda::CUDACachingAllocator::AllocatorState {
  int device = 0;
  PoolId pool;
  std::vector<SegmentInfo> segments;  // the pool's, by address
};

std::vector<SegmentInfo> pool_segments(const gpumem::DeviceAllocator& device, PoolId pool) {
  std::vector<SegmentInfo> out;
  for (SegmentInfo& segment : device.snapshot()) {
    if (segment.pool == pool) out.push_back(std::move(segment));
  }
  return out;
}

const SegmentInfo* find_segment(const std::vector<SegmentInfo>& segments, std::uintptr_t addr) {
  for (const SegmentInfo& s : segments) {
    if (s.addr == addr) return &s;
  }
  return nullptr;
}

std::string hex(std::uintptr_t addr) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(addr));
  return text;
}

// One malloc of step 3: `request` bytes must land at `addr` as a block of `size` bytes.
struct Tile {
  std::uintptr_t addr;
  std::size_t size;
  std::size_t request;
  bool keep;  // an allocated block of the checkpoint; the others are freed once all have landed
};

std::vector<Tile> tiles_for(const SegmentInfo& layout) {
  std::vector<Tile> tiles;
  for (const BlockInfo& b : layout.blocks) {
    if (b.state == BlockInfo::kAllocated) {
      // Asking for what was requested keeps requested_bytes right; a block that absorbed an
      // unsplit remainder is asked for whole.
      tiles.push_back({b.addr, b.size, round_size(b.requested) == b.size ? b.requested : b.size, true});
      continue;
    }
    const std::size_t piece = layout.small ? kSmallSize : b.size;
    for (std::size_t offset = 0; offset < b.size; offset += piece) {
      const std::size_t n = std::min(piece, b.size - offset);
      tiles.push_back({b.addr + offset, n, n, false});
    }
  }
  return tiles;
}

bool same_layout(const SegmentInfo& a, const SegmentInfo& b) {
  if (a.addr != b.addr || a.size != b.size || a.blocks.size() != b.blocks.size()) return false;
  for (std::size_t i = 0; i < a.blocks.size(); ++i) {
    const BlockInfo &x = a.blocks[i], &y = b.blocks[i];
    const bool x_allocated = x.state == BlockInfo::kAllocated, y_allocated = y.state == BlockInfo::kAllocated;
    if (x.addr != y.addr || x.size != y.size || x_allocated != y_allocated) return false;
  }
  return true;
}

SegmentInfo whole_free(const SegmentInfo& segment) {
  SegmentInfo free = segment;
  free.blocks = {{segment.addr, segment.size, 0, BlockInfo::kFree}};
  return free;
}

// What the pool should look like once restored, segments in the order step 3 cuts them.
std::vector<SegmentInfo> target_layouts(const std::vector<SegmentInfo>& now, const PoolCheckpoint& checkpoint) {
  std::vector<SegmentInfo> layouts;
  for (const SegmentInfo& s : now) {
    const SegmentInfo* saved = find_segment(checkpoint.segments, s.addr);
    layouts.push_back(saved ? *saved : whole_free(s));
  }
  std::sort(layouts.begin(), layouts.end(), [](const SegmentInfo& a, const SegmentInfo& b) {
    return a.size != b.size ? a.size < b.size : a.addr < b.addr;
  });
  return layouts;
}

// The pool's allocated blocks, by how gpumem frees them.
struct Allocated {
  std::vector<Block*> registered;  // PoolBlocks entries: allocate() DataPtrs and earlier restores
  std::vector<void*> raw;          // raw_alloc
};

// Step 1: throws, before anything changes, if the restore cannot succeed.
Allocated check_restorable(const PoolCheckpoint& checkpoint, const std::vector<SegmentInfo>& now,
                           const PoolBlocks::Map& registered, const CachingAllocator& core) {
  for (const SegmentInfo& s : checkpoint.segments) {
    const SegmentInfo* current = find_segment(now, s.addr);
    TORCH_CHECK(current && current->size == s.size && current->stream == s.stream,
                "gpumem: cannot restore the cudagraph-tree checkpoint: its segment at ", hex(s.addr),
                " is no longer in the pool");
  }
  Allocated allocated;
  for (const SegmentInfo& s : now) {
    for (const BlockInfo& b : s.blocks) {
      TORCH_CHECK(b.state != BlockInfo::kPendingFree, "gpumem: cannot restore the cudagraph-tree checkpoint: the "
                  "freed block at ", hex(b.addr), " is still in use on another stream (record_stream)");
      if (b.state != BlockInfo::kAllocated) continue;
      const Block* block = nullptr;
      if (auto it = registered.find(b.addr); it != registered.end()) {
        block = it->second;
        allocated.registered.push_back(it->second);
      } else if ((block = core.find_raw(reinterpret_cast<void*>(b.addr)))) {
        allocated.raw.push_back(reinterpret_cast<void*>(b.addr));
      }
      TORCH_CHECK(block, "gpumem: cannot restore the cudagraph-tree checkpoint: the block at ", hex(b.addr),
                  " was not allocated through this allocator");
      TORCH_CHECK(block->stream_uses.empty(), "gpumem: cannot restore the cudagraph-tree checkpoint: the block at ",
                  hex(b.addr), " is also used on another stream (record_stream)");
    }
  }
  return allocated;
}

// Step 3 (see the top of the file): the blocks that stand for the checkpoint's allocated ones.
// A tile landing anywhere else would be a gpumem bug: what was placed is freed and it throws.
std::vector<Block*> cut_segments(DeviceAllocator& d, PoolId pool, const std::vector<SegmentInfo>& layouts) {
  const std::thread::id me = std::this_thread::get_id();
  with_c10_errors([&] { d.begin_allocate_to_pool(pool, [me](StreamId) { return std::this_thread::get_id() == me; }); });
  std::vector<Block*> kept, scratch;
  std::string misplaced;
  for (const SegmentInfo& layout : layouts) {
    for (const Tile& tile : tiles_for(layout)) {
      Block* block = nullptr;
      try {
        block = d.malloc(tile.request, layout.stream);
      } catch (const std::exception& e) {
        misplaced = std::string("a malloc failed: ") + e.what();
        break;
      }
      (tile.keep ? kept : scratch).push_back(block);
      if (block->addr != tile.addr || block->size != tile.size) {
        misplaced = "a block of " + std::to_string(tile.size) + " bytes meant for " + hex(tile.addr) + " landed at " +
                    hex(block->addr) + " with " + std::to_string(block->size) + " bytes";
        break;
      }
    }
    if (!misplaced.empty()) break;
  }
  for (Block* block : scratch) CachingAllocator::free(block);
  d.end_allocate_to_pool(pool);
  if (misplaced.empty()) return kept;
  for (Block* block : kept) CachingAllocator::free(block);
  TORCH_CHECK(false, "gpumem: internal error restoring a cudagraph-tree checkpoint (", misplaced,
              "); please report it. Running without torch.compile(mode=\"reduce-overhead\") avoids this path");
}

void check_restored(const DeviceAllocator& d, const PoolCheckpoint& checkpoint) {
  for (const SegmentInfo& s : pool_segments(d, checkpoint.pool)) {
    const SegmentInfo* saved = find_segment(checkpoint.segments, s.addr);
    TORCH_CHECK(same_layout(s, saved ? *saved : whole_free(s)), "gpumem: internal error restoring a cudagraph-tree "
                "checkpoint: the segment at ", hex(s.addr), " does not match it; please report it");
  }
}

}  // namespace

std::shared_ptr<TorchAllocator::AllocatorState> TorchAllocator::getCheckpointState(DeviceIndex device, MempoolId id) {
  auto state = std::make_shared<PoolCheckpoint>();
  state->device = device;
  state->pool = torch_compat::to_gpumem(id);
  state->segments = pool_segments(this->device(device), state->pool);
  return state;
}

TorchAllocator::CheckpointDelta TorchAllocator::setCheckpointPoolState(DeviceIndex device,
                                                                        std::shared_ptr<AllocatorState> state) {
  const auto checkpoint = std::dynamic_pointer_cast<PoolCheckpoint>(state);
  TORCH_CHECK(checkpoint, "gpumem: setCheckpointPoolState was given a state gpumem did not make");
  TORCH_CHECK(checkpoint->device == device, "gpumem: a checkpoint of device ", checkpoint->device,
              " cannot be restored on device ", static_cast<int>(device));
  gpumem::DeviceAllocator& d = this->device(device);
  const PoolId pool = checkpoint->pool;
  TORCH_CHECK(d.pool_use_count(pool) > 0, "gpumem: cannot restore a checkpoint of pool (", pool.first, ", ",
              pool.second, "): the pool has been released");
  const c10::Device where(c10::DeviceType::CUDA, device);

  CheckpointDelta delta;
  // The DataPtrs are made once the map is unlocked: one destroyed while it is locked (an error
  // below) would free its block through the map and wait for the lock this thread holds.
  const std::vector<Block*> restored = pool_blocks_.locked(device, [&](PoolBlocks::Map& registered) {
    const std::vector<SegmentInfo> now = pool_segments(d, pool);
    const Allocated allocated = check_restorable(*checkpoint, now, registered, core_);
    // 2. Free every allocated block of the pool. Their stacks go with them: the blocks cut in
    // step 3 are new allocations.
    for (Block* block : allocated.registered) {
      delta.ptrs_freed.push_back(block->ptr());
      registered.erase(block->addr);
      history_.forget(History::kBlocks, device, block->addr);
      CachingAllocator::free(block);
    }
    for (void* ptr : allocated.raw) {
      delta.ptrs_freed.push_back(ptr);
      history_.forget(History::kBlocks, device, reinterpret_cast<std::uintptr_t>(ptr));
      with_c10_errors([&] { core_.raw_free(ptr); });
    }
    // 3. Cut the segments again.
    std::vector<Block*> kept = cut_segments(d, pool, target_layouts(now, *checkpoint));
    for (Block* block : kept) registered.emplace(block->addr, block);
    check_restored(d, *checkpoint);
    return kept;
  });
  for (Block* block : restored) delta.dataptrs_allocd.emplace_back(block->ptr(), context_of(block), &delete_block, where);
  return delta;
}

}  // namespace gpumem
