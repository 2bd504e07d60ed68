#include "torch/install.h"

#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <mutex>
#include <stdexcept>

#include "backends/cuda_backend.h"

namespace gpumem {

const char* const kTooLateToInstall =
    "PyTorch's own CUDA allocator has already served memory in this process, so gpumem cannot take over. "
    "Import gpumem and call gpumem.set_limit() before the first CUDA tensor, or set GPUMEM_LIMIT before the "
    "program starts.";

const char* const kAsyncBackendChosen =
    "PyTorch's allocator settings (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF) choose its cudaMallocAsync "
    "backend, which would take CUDA memory past gpumem's cap, so gpumem cannot be installed. Remove "
    "backend:cudaMallocAsync from them to run under gpumem's cap, or unset GPUMEM_LIMIT and do not call gpumem "
    "to run on cudaMallocAsync.";

namespace {

struct ProcessAllocator {
  CudaBackend backend;
  TorchAllocator allocator{backend, make_torch_cuda_context()};
};

std::mutex& install_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}

}  // namespace

TorchAllocator& process_allocator() {
  static ProcessAllocator* process = new ProcessAllocator;  // leaked on purpose (see install.h)
  return process->allocator;
}

bool is_installed() { return c10::cuda::CUDACachingAllocator::allocator.load() == &process_allocator(); }

void install(StartupSettings settings) {
  TorchAllocator& ours = process_allocator();
  std::lock_guard<std::mutex> lock(install_mutex());
  c10::cuda::CUDACachingAllocator::CUDAAllocator* current = c10::cuda::CUDACachingAllocator::allocator.load();
  if (current == &ours) return;
  if (current && current->initialized()) throw std::runtime_error(kTooLateToInstall);
  if (current && current->name() == "cudaMallocAsync") throw std::runtime_error(kAsyncBackendChosen);
  ours.core().defer_setup(startup_setup(ours, std::move(settings)));
  // The shared_ptr torch keeps must never delete the allocator: it lives as long as the process.
  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> handle(&ours, [](auto*) {});
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(handle);
  } catch (const c10::Error&) {
    throw std::runtime_error(kTooLateToInstall);
  }
  c10::SetAllocator(c10::DeviceType::CUDA, &ours);
}

}  // namespace gpumem
