// torch.cuda.memory_snapshot / _dump_snapshot and _record_memory_history: the core's segments
// in torch's SegmentInfo form, and the History's trace entries.
#include "torch/allocator.h"

namespace gpumem {

namespace {

torch_compat::TorchSegmentInfo to_torch_segment(int device, const SegmentInfo& segment, const History& history) {
  torch_compat::TorchSegmentInfo out;
  out.device = static_cast<c10::DeviceIndex>(device);
  out.address = segment.addr;
  out.total_size = segment.size;
  out.stream = reinterpret_cast<cudaStream_t>(segment.stream);
  out.is_large = !segment.small;
  out.is_expandable = segment.growable;  // the core lists each mapped stretch as a segment of its own
  out.owner_private_pool_id = torch_compat::to_torch(segment.pool);
  out.context_when_allocated = history.context(History::kSegments, device, segment.addr);
  for (const BlockInfo& block : segment.blocks) {
    torch_compat::TorchBlockInfo info;
    info.size = block.size;
    // Note [the requested size of a free block] (torch/history.h).
    info.requested_size = block.state == BlockInfo::kFree ? history.last_freed_within(device, block.addr, block.size)
                                                          : block.requested;
    // torch's states: allocated and active = active_allocated; active only = active_pending_free
    // (freed, still used by a stream); neither = inactive.
    info.allocated = block.state == BlockInfo::kAllocated;
    info.active = block.state != BlockInfo::kFree;
    if (info.allocated) {
      info.context_when_allocated = history.context(History::kBlocks, device, block.addr);
      out.allocated_size += block.size;
      out.requested_size += block.requested;
    }
    if (info.active) out.active_size += block.size;
    out.blocks.push_back(std::move(info));
  }
  return out;
}

}  // namespace

// The default pool id means every pool; another id, that pool's segments only.
TorchAllocator::SnapshotInfo TorchAllocator::snapshot_of(MempoolId mempool_id, bool include_traces) {
  const PoolId only = torch_compat::to_gpumem(mempool_id);
  SnapshotInfo info{};
  for (int d = 0; d < core_.device_count(); ++d) {
    const gpumem::DeviceAllocator* device = core_.existing(d);
    if (!device) continue;
    for (const SegmentInfo& segment : device->snapshot()) {
      if (only.is_default() || segment.pool == only) info.segments.push_back(to_torch_segment(d, segment, history_));
    }
  }
  info.device_traces = include_traces ? history_.traces(core_.device_count())
                                      : std::vector<std::vector<torch_compat::TorchTraceEntry>>(core_.device_count());
  info.config_metadata.last_allocator_settings = "gpumem";
  return info;
}

#if GPUMEM_TORCH_HAS_INCLUDE_TRACES
TorchAllocator::SnapshotInfo TorchAllocator::snapshot(MempoolId mempool_id, bool include_traces) {
  return snapshot_of(mempool_id, include_traces);
}
#elif GPUMEM_TORCH_HAS_SNAPSHOT_POOL
TorchAllocator::SnapshotInfo TorchAllocator::snapshot(MempoolId mempool_id) { return snapshot_of(mempool_id, true); }
#else
TorchAllocator::SnapshotInfo TorchAllocator::snapshot() { return snapshot_of({0, 0}, true); }
#endif

// Stacks as native keeps them: see history.h.
void TorchAllocator::recordHistory(bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                                   size_t alloc_trace_max_entries, c10::cuda::CUDACachingAllocator::RecordContext when
                                   GPUMEM_CLEAR_HISTORY_PARAM GPUMEM_SKIP_ACTIONS_PARAM) {
  history_.configure(enabled, context_recorder, alloc_trace_max_entries, when, GPUMEM_CLEAR_HISTORY_ARG,
                     GPUMEM_SKIP_ACTIONS_ARG);
}

bool TorchAllocator::isHistoryEnabled() { return history_.enabled(); }

#if GPUMEM_TORCH_HAS_COMPILE_CONTEXT
void TorchAllocator::pushCompileContext(std::string& md) { history_.push_compile_context(md); }
void TorchAllocator::popCompileContext() { history_.pop_compile_context(); }
#endif

#if GPUMEM_TORCH_HAS_USER_METADATA
void TorchAllocator::setUserMetadata(const std::string& metadata) { history_.set_user_metadata(metadata); }
std::string TorchAllocator::getUserMetadata() { return history_.user_metadata(); }
#endif

}  // namespace gpumem
