#include "torch/cuda_context.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace gpumem {

namespace {

class TorchCudaContext final : public CudaContext {
 public:
  int current_device() override { return c10::cuda::current_device(); }
  StreamId current_stream(int device) override {
    return reinterpret_cast<StreamId>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
  }
  void on_device(int device, const std::function<void()>& f) override {
    const c10::cuda::CUDAGuard current(static_cast<c10::DeviceIndex>(device));
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    f();
  }
};

}  // namespace

std::unique_ptr<CudaContext> make_torch_cuda_context() { return std::make_unique<TorchCudaContext>(); }

}  // namespace gpumem
