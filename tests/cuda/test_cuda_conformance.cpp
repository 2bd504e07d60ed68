// The backend conformance suite (tests/cpp/backend_conformance.h) for the CUDA backend: needs a GPU,
// so it is its own binary, not among CTest's tests; tools/gpu_check.sh (CONFORMANCE=1) builds and
// runs it on a GPU machine. Without a CUDA device it says so and fails: it is never run to pass
// vacuously.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>
#include <tuple>

#include "backends/cuda_backend.h"

namespace {

struct CudaFixture {
  gpumem::CudaBackend backend;
  std::string name = "CUDA backend";
  // The GPU machines this suite runs on have the driver's virtual memory: a page size of 0 there
  // would mean the backend lost its growable segments.
  bool has_virtual_memory = true;
  bool has_process_accounting = true;  // a GPU machine whose driver lists this process (no pid namespace)
};

}  // namespace

using ConformanceBackends = std::tuple<CudaFixture>;

#include "../cpp/backend_conformance.h"

int main(int argc, char** argv) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "gpumem_cuda_conformance: no CUDA device; it runs on a GPU machine only\n");
    return 2;
  }
  return Catch::Session().run(argc, argv);
}
