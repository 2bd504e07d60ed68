// The CUDA driver calls gpumem needs (virtual memory), found at run time through the runtime's
// entry-point lookup. gpumem never links libcuda, so the module imports on a machine with no
// driver; there find_driver() has nothing and the backend offers no virtual memory.
#pragma once

#include <cuda.h>  // types only; every call goes through DriverApi

namespace gpumem {

// Every driver call used, declared once: the struct and its loader derive from this list.
#define GPUMEM_DRIVER_CALLS(X)     \
  X(cuGetErrorString)              \
  X(cuDeviceGet)                   \
  X(cuDeviceGetAttribute)          \
  X(cuMemGetAllocationGranularity) \
  X(cuMemAddressReserve)           \
  X(cuMemAddressFree)              \
  X(cuMemCreate)                   \
  X(cuMemRelease)                  \
  X(cuMemMap)                      \
  X(cuMemUnmap)                    \
  X(cuMemSetAccess)                \
  X(cuMemRetainAllocationHandle)   \
  X(cuMemExportToShareableHandle)  \
  X(cuMemImportFromShareableHandle)

struct DriverApi {
#define GPUMEM_DRIVER_FIELD(name) decltype(&::name) name = nullptr;
  GPUMEM_DRIVER_CALLS(GPUMEM_DRIVER_FIELD)
#undef GPUMEM_DRIVER_FIELD
};

// The driver's calls, loaded on first use; nullptr when any of them cannot be had (no driver, or
// one too old).
const DriverApi* find_driver();

// The driver's calls; throws std::runtime_error when find_driver() has none.
const DriverApi& driver();

// Throws std::runtime_error("gpumem: <what> failed: <the driver's text>") unless `status` is
// CUDA_SUCCESS.
void check_driver(CUresult status, const char* what);

}  // namespace gpumem
