// The backend conformance suite (backend_conformance.h) for the simulated device, with and without
// virtual memory and process accounting.
#include <string>
#include <tuple>

#include "backends/sim_backend.h"

namespace {

constexpr std::size_t kCapacity = std::size_t{256} << 20;

struct SimPlainFixture {
  gpumem::SimBackend backend{kCapacity};
  std::string name = "simulated device, plain";
  bool has_virtual_memory = false;
  bool has_process_accounting = true;
};

struct SimPagedFixture {
  gpumem::SimBackend backend{kCapacity, 2};
  std::string name = "simulated device with virtual memory, no process accounting";
  bool has_virtual_memory = true;
  bool has_process_accounting = false;
  SimPagedFixture() {
    backend.enable_virtual_memory(std::size_t{2} << 20);
    backend.set_process_accounting(false);
  }
};

}  // namespace

using ConformanceBackends = std::tuple<SimPlainFixture, SimPagedFixture>;

#include "backend_conformance.h"
