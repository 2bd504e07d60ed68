// What gpumem hands to the CUDA runtime unchanged: copies and peer access.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "torch/allocator.h"
#include "torch/error_bridge.h"

namespace gpumem {

void TorchAllocator::copy_data(void* dest, const void* src, size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

// Runtime peer access covers cudaMalloc'd memory only. Pages of growable segments carry their own
// access list, so the backend also grants `dev` the pages mapped on `dev_to_access`, those mapped
// so far and those it maps later.
void TorchAllocator::enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) {
  c10::cuda::CUDAGuard guard(dev);
  const cudaError_t status = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (status == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // already on is success
  } else {
    C10_CUDA_CHECK(status);
  }
  with_c10_errors([&] { traced_.grant_peer(dev_to_access, dev); });
}

// Within a device, or with peer access on, a plain async copy; across devices without it, the peer
// copy, which works for any device memory.
cudaError_t TorchAllocator::memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                                        cudaStream_t stream, bool p2p_enabled) {
  if (p2p_enabled || dst_device == src_device) return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
}

}  // namespace gpumem
