// What differs between the torch releases gpumem builds against (2.4 to 2.15).
//
// The build (setup.py's torch_feature_macros, also used by CMake) reads the installed torch's
// headers and defines GPUMEM_TORCH_HAS_<FEATURE> to 0 or 1 for each interface change it knows;
// this file turns them into the parameter lists and the few names that differ, so the adapter has
// one source. tools/check_torch_compat.py compiles it against every release's headers
// (docs/compatibility.md). A release that adds a new pure virtual shows up there as an
// abstract-class error: add its probe to setup.py and its override under a macro here.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#if GPUMEM_TORCH_HAS_CAPTURE_RECORD_STREAM_REUSE || GPUMEM_TORCH_HAS_CUDA_ROUNDUP_DIVISIONS
#include <c10/cuda/CUDAAllocatorConfig.h>
#endif
#if GPUMEM_TORCH_HAS_ROUNDUP_DIVISIONS
#include <c10/core/AllocatorConfig.h>
#endif

#include <string>
#include <vector>

#include "core/block.h"
#include "core/pool.h"
#include "core/sizing.h"

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

// A trace entry with no time yet (the caller sets time_.t_). Entries name their pool since 2.8.
inline TorchTraceEntry make_trace_entry(TorchTraceEntry::Action action, c10::DeviceIndex device, std::uintptr_t addr,
                                        std::size_t size, cudaStream_t stream, const PoolId& pool,
                                        std::shared_ptr<c10::GatheredContext> context) {
#if GPUMEM_TORCH_HAS_TRACE_ENTRY_POOL
  return TorchTraceEntry(action, device, addr, size, stream, to_torch(pool), 0, std::move(context));
#else
  (void)pool;
  return TorchTraceEntry(action, device, addr, size, stream, 0, std::move(context));
#endif
}

// torch's graph_capture_record_stream_reuse setting (PYTORCH_CUDA_ALLOC_CONF,
// _set_allocator_settings), where this torch has it.
inline bool capture_record_stream_reuse() {
#if GPUMEM_TORCH_HAS_CAPTURE_RECORD_STREAM_REUSE
  return c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::graph_capture_record_stream_reuse();
#else
  return false;
#endif
}

// The divisions torch's roundup_power2_divisions setting gives a request of `size` bytes, as
// native reads them. torch's own lookup (roundup_power2_divisions(size)) is a call into libc10
// that also passes instance()'s guard of the lazy environment parse each time, about 40
// instructions on every allocation. Where torch exposes the table itself, its address is taken
// once (the config is a process-wide singleton, so the table never moves; a setting parsed later
// rewrites its entries, which every read sees, as native's reads do) and the band is found
// inline: a size's power of two less 20 (1 MiB), kept within the table, so sizes below 2 MiB are
// in band 0, [2^(20+k), 2^(21+k)) in band k, and sizes from 32 GiB on in band 15.
// tests/cpp_torch/test_allocate.cpp checks it against torch's lookup for every band under
// several settings.
inline std::size_t divisions_of(std::size_t size) {
#if GPUMEM_TORCH_HAS_ROUNDUP_DIVISIONS && GPUMEM_TORCH_HAS_ROUNDUP_DIVISIONS_TABLE
  static const std::vector<size_t>& table = c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions();
  constexpr int kFirstBandLog2 = 20;
  const int log2 = 63 - __builtin_clzll(static_cast<unsigned long long>(size) | 1);  // size 0 in band 0
  std::size_t band = log2 > kFirstBandLog2 ? static_cast<std::size_t>(log2 - kFirstBandLog2) : 0;
  if (band >= table.size()) {
    if (table.empty()) return 0;
    band = table.size() - 1;
  }
  return table[band];
#elif GPUMEM_TORCH_HAS_ROUNDUP_DIVISIONS
  return c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(size);
#elif GPUMEM_TORCH_HAS_CUDA_ROUNDUP_DIVISIONS
  return cca::CUDAAllocatorConfig::roundup_power2_divisions(size);
#else
  (void)size;
  return 0;
#endif
}

// What that setting rounds a request of `size` bytes up to, as native rounds it; 0 where it does
// not apply (no divisions for the size's band, a small size, or a torch without the setting).
inline std::size_t power2_division_size(std::size_t size) {
#if GPUMEM_TORCH_HAS_ROUNDUP_DIVISIONS || GPUMEM_TORCH_HAS_CUDA_ROUNDUP_DIVISIONS
  const std::size_t divisions = divisions_of(size);
  if (divisions <= 1 || size <= kMinBlockSize * divisions) return 0;
  return round_to_division(size, divisions);
#else
  (void)size;
  return 0;
#endif
}

// Tags an entry with the compile region and the user's metadata, where torch's entries have them.
inline void tag_trace_entry(TorchTraceEntry& entry, const std::string& compile_context, const std::string& metadata) {
#if GPUMEM_TORCH_HAS_TRACE_ENTRY_COMPILE_CONTEXT
  entry.compile_context_ = compile_context;
#endif
#if GPUMEM_TORCH_HAS_TRACE_ENTRY_USER_METADATA
  entry.user_metadata_ = metadata;
#endif
  (void)entry, (void)compile_context, (void)metadata;
}

}  // namespace gpumem::torch_compat

// `override` where torch declares the virtual (GPUMEM_OVERRIDE_IF(GPUMEM_TORCH_HAS_X)); before that
// release the member is gpumem's own, which torch does not call.
#define GPUMEM_OVERRIDE_IF(has) GPUMEM_OVERRIDE_IF_(has)
#define GPUMEM_OVERRIDE_IF_(has) GPUMEM_OVERRIDE_IF_##has
#define GPUMEM_OVERRIDE_IF_0
#define GPUMEM_OVERRIDE_IF_1 override

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
