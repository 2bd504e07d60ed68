// Where the adapter learns the caller's current device and stream.
//
// torch keeps both per thread (c10::cuda::current_device, getCurrentCUDAStream); asking them needs
// the CUDA runtime and a GPU. The adapter asks through this interface instead, so its tests run on
// a machine with neither: they pass a context that returns fixed values.
#pragma once

#include <functional>
#include <memory>

#include "core/backend.h"

namespace gpumem {

class CudaContext {
 public:
  virtual ~CudaContext() = default;
  virtual int current_device() = 0;
  virtual StreamId current_stream(int device) = 0;
  // Runs f() with `device` current and stream capture relaxed on this thread (CUDA refuses
  // allocations on a capturing thread otherwise), as native does around a MemPool allocator's
  // calls; both are restored afterwards, also when f throws.
  virtual void on_device(int device, const std::function<void()>& f) = 0;
};

// torch's view: c10::cuda::current_device() and getCurrentCUDAStream(device).
std::unique_ptr<CudaContext> make_torch_cuda_context();

}  // namespace gpumem
