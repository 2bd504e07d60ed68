#include "torch/cuda_context.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

namespace gpumem {

namespace {

class TorchCudaContext final : public CudaContext {
 public:
  int current_device() override { return c10::cuda::current_device(); }
  StreamId current_stream(int device) override {
    return reinterpret_cast<StreamId>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
  }
};

}  // namespace

std::unique_ptr<CudaContext> make_torch_cuda_context() { return std::make_unique<TorchCudaContext>(); }

}  // namespace gpumem
