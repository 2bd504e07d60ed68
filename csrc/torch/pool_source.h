// A torch.cuda.MemPool's own allocator (torch.cuda.memory.CUDAPluggableAllocator: a user's
// alloc/free functions, NCCL's) as the SegmentSource of its pool in the core.
//
// As native does: a segment is the allocator's raw_alloc(bytes) with the pool's device current
// (and stream capture relaxed); nullptr, or a c10::OutOfMemoryError, means the device has no memory
// for it and the core's OOM path runs; it goes back through raw_delete(ptr), never cudaFree. The
// cap is the core's business (reserved before raw_alloc is called, given back if it fails or
// throws). The allocator is held by a shared_ptr (torch 2.11) for as long as the pool holds a
// segment from it; before 2.11 torch passes a raw pointer, kept alive by the MemPool that owns it.
//
// Both calls run with the core's device lock held: an allocator that calls back into torch's CUDA
// allocator (gpumem) from inside them would deadlock, as it would natively. A segment given back
// takes the history's notes of what was freed in it along (Note [the requested size of a free
// block], torch/history.h), as the TracingBackend's segments do.
#pragma once

#include <cstddef>
#include <utility>

#include "core/segment_source.h"
#include "torch/compat.h"
#include "torch/cuda_context.h"
#include "torch/history.h"

namespace gpumem {

class TorchPoolSource final : public SegmentSource {
 public:
  TorchPoolSource(GPUMEM_POOL_ALLOCATOR_TYPE allocator, int device, CudaContext& context, History& history)
      : allocator_(std::move(allocator)), device_(device), context_(context), history_(history) {}

  void* reserve(std::size_t bytes) override;
  void release(void* ptr, std::size_t bytes) override;

 private:
  GPUMEM_POOL_ALLOCATOR_TYPE allocator_;
  const int device_;
  CudaContext& context_;
  History& history_;
};

}  // namespace gpumem
