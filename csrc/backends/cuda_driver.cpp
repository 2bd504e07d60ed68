#include "backends/cuda_driver.h"

#include <cuda_runtime_api.h>

#include <optional>
#include <stdexcept>
#include <string>

namespace gpumem {

namespace {

// The driver ABI the calls are asked for. Every call in GPUMEM_DRIVER_CALLS has kept its signature
// since 12.0, so cuda.h's prototypes (of any newer toolkit) match what the driver hands back.
constexpr unsigned int kDriverAbi = 12000;

void* entry_point(const char* name) {
  void* fn = nullptr;
#if CUDART_VERSION >= 12050
  const cudaError_t status = cudaGetDriverEntryPointByVersion(name, &fn, kDriverAbi, cudaEnableDefault);
#else
  const cudaError_t status = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault);
#endif
  if (status != cudaSuccess) {
    cudaGetLastError();  // no driver is an answer here, not an error for the caller's next call
    return nullptr;
  }
  return fn;
}

template <typename Fn>
bool load(Fn& fn, const char* name) {
  fn = reinterpret_cast<Fn>(entry_point(name));
  return fn != nullptr;
}

std::optional<DriverApi> load_driver() {
  DriverApi api;
  bool found = true;
#define GPUMEM_DRIVER_LOAD(name) found = load(api.name, #name) && found;
  GPUMEM_DRIVER_CALLS(GPUMEM_DRIVER_LOAD)
#undef GPUMEM_DRIVER_LOAD
  if (!found) return std::nullopt;
  return api;
}

}  // namespace

const DriverApi* find_driver() {
  static const std::optional<DriverApi> api = load_driver();  // once; a static's initializer is thread-safe
  return api ? &*api : nullptr;
}

const DriverApi& driver() {
  const DriverApi* api = find_driver();
  if (!api) throw std::runtime_error("gpumem: the CUDA driver's virtual memory calls are not available");
  return *api;
}

void check_driver(CUresult status, const char* what) {
  if (status == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (driver().cuGetErrorString(status, &text) != CUDA_SUCCESS || !text) text = "unknown CUDA driver error";
  throw std::runtime_error(std::string("gpumem: ") + what + " failed: " + text);
}

}  // namespace gpumem
