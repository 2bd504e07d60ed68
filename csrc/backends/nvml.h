// The driver's own account of what each process holds on a GPU, through NVML, for a limit on the
// whole process (Note [a limit on the whole process], core/process_scope.cpp). NVML is loaded at
// run time (libnvidia-ml.so.1, which the driver installs): gpumem never links it, so the module
// imports on a machine without a driver, and there nvml_process_memory() has nothing.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include "core/backend.h"

namespace gpumem {

// The bytes the driver counts for process `pid` on the GPU at PCI bus id `pci_bus_id` (as
// cudaDeviceGetPCIBusId writes it), summed over its entries there; nullopt where NVML cannot be
// loaded or started, the GPU is not found, the process is not listed (a container's own pid
// namespace), or its figure is not available (MIG). Thread-safe; never throws.
std::optional<std::size_t> nvml_process_memory(const char* pci_bus_id, unsigned pid) noexcept;

// Every process NVML lists on that GPU, one entry per pid (its entries summed), those whose figure
// is not available left out; empty where NVML cannot answer. Thread-safe; never throws.
std::vector<ProcessUse> nvml_processes(const char* pci_bus_id) noexcept;

}  // namespace gpumem
