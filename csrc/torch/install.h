// The process's gpumem allocator over the CUDA runtime, and its installation as torch's CUDA
// allocator.
#pragma once

#include "torch/allocator.h"
#include "torch/startup.h"

namespace gpumem {

// Made on first use over a CudaBackend and never destroyed: DataPtrs it hands out may be freed at
// any point until the process ends. It works before install(): limits set on it then apply once
// torch starts allocating through it.
TorchAllocator& process_allocator();

// Makes process_allocator() torch's CUDA allocator (CUDAPluggableAllocator::changeCurrentAllocator)
// and c10's allocator for kCUDA (c10::GetAllocator, used by torch.accelerator). Idempotent.
// Throws std::runtime_error, changing nothing, when torch's own allocator has already been
// initialized (it may have served memory that gpumem could never account for), or when torch's
// settings chose its cudaMallocAsync backend (they would then fight over the allocator).
// Touches no CUDA: the first install hands `settings` to the core's deferred setup
// (torch/startup.h), which applies them when the devices are first used; later installs change
// nothing.
void install(StartupSettings settings = {});
bool is_installed();

extern const char* const kTooLateToInstall;
extern const char* const kAsyncBackendChosen;

}  // namespace gpumem
