// What differs between the torch releases gpumem builds against (2.6 to 2.15).
//
// The build (setup.py's torch_feature_macros, also used by CMake) reads the installed torch's
// headers and defines GPUMEM_TORCH_HAS_<FEATURE> to 0 or 1 for each interface change it knows;
// this file turns them into the parameter lists and the few names that differ, so the adapter has
// one source. A release that adds a new pure virtual shows up as an abstract-class error in
// allocator.cpp: add its probe to setup.py and its override under a macro here.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include "core/block.h"

#ifndef GPUMEM_TORCH_HAS_DEVICE_ALLOCATOR_BASE
#error "gpumem: build through setup.py or CMake, which define the GPUMEM_TORCH_HAS_* macros from the installed torch's headers"
#endif

namespace gpumem::torch_compat {

namespace cca = c10::cuda::CUDACachingAllocator;

using CUDAAllocator = cca::CUDAAllocator;
using TorchPoolId = c10::cuda::MempoolId_t;
using TorchDeviceStats = cca::DeviceStats;
using TorchSegmentInfo = cca::SegmentInfo;
using TorchBlockInfo = cca::BlockInfo;
using TorchTraceEntry = cca::TraceEntry;

inline PoolId to_gpumem(const TorchPoolId& id) { return {id.first, id.second}; }
inline TorchPoolId to_torch(const PoolId& id) { return {id.first, id.second}; }

}  // namespace gpumem::torch_compat

// recordHistory's trailing parameters.
#if GPUMEM_TORCH_HAS_CLEAR_HISTORY
#define GPUMEM_CLEAR_HISTORY_PARAM , bool clear_history
#define GPUMEM_CLEAR_HISTORY_ARG clear_history
#else
#define GPUMEM_CLEAR_HISTORY_PARAM
#define GPUMEM_CLEAR_HISTORY_ARG false
#endif
#if GPUMEM_TORCH_HAS_SKIP_ACTIONS
#define GPUMEM_SKIP_ACTIONS_PARAM , const std::vector<std::string>& skip_actions
#define GPUMEM_SKIP_ACTIONS_ARG skip_actions
#else
#define GPUMEM_SKIP_ACTIONS_PARAM
#define GPUMEM_SKIP_ACTIONS_ARG std::vector<std::string>{}
#endif

// createOrIncrefPool's allocator argument: a raw pointer before 2.11, a shared_ptr since.
#if GPUMEM_TORCH_HAS_POOL_ALLOCATOR_SHARED_PTR
#define GPUMEM_POOL_ALLOCATOR_TYPE std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>
#else
#define GPUMEM_POOL_ALLOCATOR_TYPE c10::cuda::CUDACachingAllocator::CUDAAllocator*
#endif
