// torch's allocator settings (PYTORCH_CUDA_ALLOC_CONF's parser and the values it keeps), wherever
// the torch release under test keeps them: c10/core's AcceleratorAllocatorConfig in the releases
// that have it, c10/cuda's CUDAAllocatorConfig before (2.6 to 2.8 at least).
#pragma once

#include <cstddef>
#include <string>

#if GPUMEM_TORCH_HAS_ROUNDUP_DIVISIONS
#include <c10/core/AllocatorConfig.h>
#else
#include <c10/cuda/CUDAAllocatorConfig.h>
#endif

namespace gpumem::testing {

inline void set_torch_settings(const std::string& text) {
#if GPUMEM_TORCH_HAS_ROUNDUP_DIVISIONS
  c10::CachingAllocator::setAllocatorSettings(text);
#else
  c10::cuda::CUDACachingAllocator::setAllocatorSettings(text);
#endif
}

// torch's own lookup of roundup_power2_divisions for a size.
inline std::size_t torch_divisions(std::size_t size) {
#if GPUMEM_TORCH_HAS_ROUNDUP_DIVISIONS
  return c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(size);
#else
  return c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::roundup_power2_divisions(size);
#endif
}

}  // namespace gpumem::testing
