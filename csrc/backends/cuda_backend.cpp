#include "backends/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "core/errors.h"

namespace gpumem {

namespace {

void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  throw std::runtime_error(std::string("gpumem: ") + what + " failed: " + cudaGetErrorString(status));
}

// Makes `device` current for the scope and restores the caller's device after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    switched_ = previous_ != device;
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// While a CUDA graph is being captured in the global or thread-local mode (torch's), CUDA refuses
// cudaMalloc and cudaMemGetInfo on the capturing thread. A private pool grows during capture, so
// its segments are reserved then: relax the thread's mode around those calls, as PyTorch's own
// allocator does. A segment reserved during capture is safe: replays reuse its address.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace

CudaBackend::CudaBackend() {
  if (cudaGetDeviceCount(&device_count_) != cudaSuccess) {
    cudaGetLastError();
    device_count_ = 0;
  }
  spare_events_.resize(device_count_);
}

void* CudaBackend::reserve(int device, std::size_t bytes) {
  DeviceScope scope(device);
  RelaxedCaptureMode relaxed;
  void* ptr = nullptr;
  const cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clears the sticky-looking but recoverable error
    return nullptr;
  }
  check(status, "cudaMalloc");
  return ptr;
}

void CudaBackend::release(int device, void* ptr, std::size_t) {
  DeviceScope scope(device);
  check(cudaFree(ptr), "cudaFree");
}

MemInfo CudaBackend::mem_info(int device) {
  if (device < 0 || device >= device_count_) {
    throw DeviceError("gpumem: CUDA device " + std::to_string(device) + " does not exist; this process sees " +
                      std::to_string(device_count_) + " (CUDA_VISIBLE_DEVICES applies)");
  }
  DeviceScope scope(device);
  RelaxedCaptureMode relaxed;
  MemInfo info;
  check(cudaMemGetInfo(&info.free, &info.total), "cudaMemGetInfo");
  return info;
}

EventId CudaBackend::record_event(int device, StreamId stream) {
  DeviceScope scope(device);
  cudaEvent_t event = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& spare = spare_events_[device];
    if (!spare.empty()) {
      event = static_cast<cudaEvent_t>(spare.back());
      spare.pop_back();
    }
  }
  if (!event) check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaEventRecord(event, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord");
  return event;
}

bool CudaBackend::event_done(int device, EventId event) {
  DeviceScope scope(device);
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(status, "cudaEventQuery");
  return true;
}

void CudaBackend::destroy_event(int device, EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  spare_events_[device].push_back(event);
}

void CudaBackend::synchronize(int device) {
  DeviceScope scope(device);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace gpumem
