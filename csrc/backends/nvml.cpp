#include "backends/nvml.h"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace gpumem {

namespace {

// The part of NVML's interface used here, as its header declares it (stable since NVML 11).
using NvmlReturn = int;
using NvmlDevice = struct NvmlDeviceOpaque*;
constexpr NvmlReturn kNvmlSuccess = 0;
constexpr NvmlReturn kNvmlInsufficientSize = 7;
constexpr unsigned long long kNvmlValueNotAvailable = ~0ULL;

// nvmlProcessInfo_v2_t, as nvmlDeviceGetComputeRunningProcesses_v2 fills it. The _v2 call is used,
// not _v3: some R535 drivers wrote a longer entry (with usedGpuCcProtectedMemory) through _v3,
// while _v2's layout has never changed.
struct NvmlProcessInfo {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};
static_assert(sizeof(NvmlProcessInfo) == 24, "nvmlProcessInfo_v2_t is 24 bytes");

struct Nvml {
  NvmlReturn (*init)() = nullptr;
  NvmlReturn (*handle_by_pci_bus_id)(const char*, NvmlDevice*) = nullptr;
  NvmlReturn (*compute_processes)(NvmlDevice, unsigned int*, NvmlProcessInfo*) = nullptr;
};

template <class F>
bool find(void* library, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(library, name));
  return fn != nullptr;
}

// NVML, loaded and started on first use; nullptr when it cannot be. Never unloaded: the driver
// keeps its own state for the process's lifetime anyway.
const Nvml* nvml() {
  static const Nvml* loaded = [] () -> const Nvml* {
    void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!library) return nullptr;
    static Nvml api;
    if (!find(library, "nvmlInit_v2", api.init) ||
        !find(library, "nvmlDeviceGetHandleByPciBusId_v2", api.handle_by_pci_bus_id) ||
        !find(library, "nvmlDeviceGetComputeRunningProcesses_v2", api.compute_processes) ||
        api.init() != kNvmlSuccess) {
      return nullptr;
    }
    return &api;
  }();
  return loaded;
}

// NVML's entries for the GPU (a process may have several), or nullopt where it cannot answer.
std::optional<std::vector<NvmlProcessInfo>> listed(const char* pci_bus_id) {
  const Nvml* api = nvml();
  if (!api) return std::nullopt;
  NvmlDevice device = nullptr;
  if (api->handle_by_pci_bus_id(pci_bus_id, &device) != kNvmlSuccess) return std::nullopt;
  // The list may grow between asking its length and reading it: ask again, with more room.
  std::vector<NvmlProcessInfo> processes(16);
  for (int attempt = 0; attempt < 8; ++attempt) {
    auto count = static_cast<unsigned int>(processes.size());
    const NvmlReturn status = api->compute_processes(device, &count, processes.data());
    if (status == kNvmlInsufficientSize) {
      processes.resize(static_cast<std::size_t>(count) * 2 + 16);
      continue;
    }
    if (status != kNvmlSuccess) return std::nullopt;
    processes.resize(std::min<std::size_t>(count, processes.size()));
    return processes;
  }
  return std::nullopt;
}

std::optional<std::size_t> process_memory(const char* pci_bus_id, unsigned pid) {
  const auto processes = listed(pci_bus_id);
  if (!processes) return std::nullopt;
  std::optional<std::size_t> used;
  for (const NvmlProcessInfo& p : *processes) {
    if (p.pid != pid) continue;
    if (p.used_gpu_memory == kNvmlValueNotAvailable) return std::nullopt;
    used = used.value_or(0) + static_cast<std::size_t>(p.used_gpu_memory);
  }
  return used;
}

std::vector<ProcessUse> processes(const char* pci_bus_id) {
  std::vector<ProcessUse> out;
  const auto entries = listed(pci_bus_id);
  if (!entries) return out;
  std::vector<std::pair<unsigned, std::size_t>> bytes_of;  // a pid's entries summed, in NVML's order
  for (const NvmlProcessInfo& p : *entries) {
    if (p.used_gpu_memory == kNvmlValueNotAvailable) continue;
    auto same = std::find_if(bytes_of.begin(), bytes_of.end(), [&](const auto& u) { return u.first == p.pid; });
    if (same == bytes_of.end()) same = bytes_of.insert(bytes_of.end(), {p.pid, 0});
    same->second += static_cast<std::size_t>(p.used_gpu_memory);
  }
  for (const auto& [pid, bytes] : bytes_of) out.push_back(ProcessUse{pid, bytes});
  return out;
}

}  // namespace

std::optional<std::size_t> nvml_process_memory(const char* pci_bus_id, unsigned pid) noexcept {
  try {
    return process_memory(pci_bus_id, pid);
  } catch (...) {  // the list's memory: nothing to report then
    return std::nullopt;
  }
}

std::vector<ProcessUse> nvml_processes(const char* pci_bus_id) noexcept {
  try {
    return processes(pci_bus_id);
  } catch (...) {  // the list's memory: nothing to report then
    return {};
  }
}

}  // namespace gpumem
