#include "backends/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda_driver.h"
#include "backends/nvml.h"
#include "core/errors.h"

namespace gpumem {

namespace {

void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  throw std::runtime_error(std::string("gpumem: ") + what + " failed: " + cudaGetErrorString(status));
}

// Makes `device` current for the scope and restores the caller's device after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    switched_ = previous_ != device;
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// While a CUDA graph is being captured in the global or thread-local mode (torch's), CUDA refuses
// cudaMalloc and cudaMemGetInfo on the capturing thread. A private pool grows during capture, so
// its segments are reserved then: relax the thread's mode around those calls, as PyTorch's own
// allocator does. A segment reserved during capture is safe: replays reuse its address. The mode
// is the thread's, shared by the driver's calls, so the same holds for reserving and mapping pages.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// ---- Virtual memory helpers --------------------------------------------------------------------

CUmemAllocationProp pinned_on(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

CUmemAccessDesc read_write_for(int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

// The device's mapping granularity, or 0 where it cannot map pages or the driver cannot say:
// either way the allocator falls back to plain segments, so nothing here throws.
std::size_t query_page_size(int device) {
  const DriverApi* api = find_driver();
  if (!api) return 0;
  CUdevice handle = 0;
  int supported = 0;
  if (api->cuDeviceGet(&handle, device) != CUDA_SUCCESS) return 0;
  const CUdevice_attribute vmm = CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
  if (api->cuDeviceGetAttribute(&supported, vmm, handle) != CUDA_SUCCESS || supported != 1) return 0;
  const CUmemAllocationProp prop = pinned_on(device);
  std::size_t page = 0;
  if (api->cuMemGetAllocationGranularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) return 0;
  return page;
}

// The physical allocations one map() call has mapped so far, each a mapping of its own. Unless
// kept they are unmapped when it goes, so a map() that runs out of memory part way, or throws,
// leaves nothing mapped.
class MappedChunks {
 public:
  MappedChunks(const DriverApi& api, int device, CUdeviceptr base) : api_(api), prop_(pinned_on(device)), base_(base) {}
  ~MappedChunks() {
    if (kept_) return;
    for (const auto& [addr, bytes] : chunks_) api_.cuMemUnmap(addr, bytes);  // best effort: a destructor cannot throw
  }
  MappedChunks(const MappedChunks&) = delete;
  MappedChunks& operator=(const MappedChunks&) = delete;

  std::size_t bytes() const { return bytes_; }
  const std::vector<std::pair<std::uintptr_t, std::size_t>>& chunks() const { return chunks_; }
  void keep() { kept_ = true; }

  // Backs the next `bytes` with one new allocation; false when the device has no memory for it.
  bool map_next(std::size_t bytes) {
    CUmemGenericAllocationHandle handle = 0;
    const CUresult created = api_.cuMemCreate(&handle, bytes, &prop_, 0);
    if (created == CUDA_ERROR_OUT_OF_MEMORY) return false;
    check_driver(created, "cuMemCreate");
    const CUdeviceptr at = base_ + bytes_;
    const CUresult mapped = api_.cuMemMap(at, bytes, 0, handle, 0);
    api_.cuMemRelease(handle);  // the mapping keeps the memory alive; cuMemUnmap frees it
    if (mapped == CUDA_ERROR_OUT_OF_MEMORY) return false;
    check_driver(mapped, "cuMemMap");
    chunks_.emplace_back(at, bytes);
    bytes_ += bytes;
    return true;
  }

 private:
  const DriverApi& api_;
  const CUmemAllocationProp prop_;
  const CUdeviceptr base_;
  std::size_t bytes_ = 0;
  std::vector<std::pair<std::uintptr_t, std::size_t>> chunks_;
  bool kept_ = false;
};

// Lets `device` and its granted peers read and write [addr, addr + bytes).
CUresult allow_access(int device, const std::vector<int>& peers, CUdeviceptr addr, std::size_t bytes) {
  std::vector<CUmemAccessDesc> access{read_write_for(device)};
  for (int peer : peers) access.push_back(read_write_for(peer));
  return driver().cuMemSetAccess(addr, bytes, access.data(), access.size());
}

// Takes the mappings that make up [addr, addr + bytes) out of `mapped` and returns them; throws,
// changing nothing, unless they are whole mappings that cover it exactly.
std::vector<std::pair<std::uintptr_t, std::size_t>> take_mappings(std::map<std::uintptr_t, std::size_t>& mapped,
                                                                  std::uintptr_t addr, std::size_t bytes) {
  std::vector<std::pair<std::uintptr_t, std::size_t>> taken;
  if (bytes == 0) return taken;
  std::uintptr_t at = addr;
  for (auto it = mapped.find(addr); it != mapped.end() && it->first == at && at < addr + bytes; ++it) {
    taken.emplace_back(*it);
    at += it->second;
  }
  if (at != addr + bytes) {
    throw std::logic_error("gpumem: unmap of " + std::to_string(bytes) + " bytes at " + std::to_string(addr) +
                           " is not made of whole mappings of map()");
  }
  mapped.erase(mapped.find(addr), mapped.lower_bound(addr + bytes));
  return taken;
}

}  // namespace

// Note [no CUDA before first use]
//   The backend is made when gpumem is installed, which GPUMEM_LIMIT does at torch's import. Counting
//   the devices starts the driver (cuInit): after that, CUDA_VISIBLE_DEVICES set by the program is
//   ignored and a forked child cannot use CUDA. So nothing here calls CUDA until a caller needs the
//   devices: the count is taken once, on first ask.
int CudaBackend::device_count() const {
  std::call_once(counted_, [this] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      count = 0;
    }
    spare_events_.resize(count);
    vm_.resize(count);
    totals_ = std::vector<std::optional<std::size_t>>(count);
    bus_ids_ = std::vector<std::string>(count);
    device_count_ = count;
  });
  return device_count_;
}

void CudaBackend::check_device(int device) const {
  const int count = device_count();
  if (device < 0 || device >= count) {
    throw DeviceError("gpumem: CUDA device " + std::to_string(device) + " does not exist; this process sees " +
                      std::to_string(count) + " (CUDA_VISIBLE_DEVICES applies)");
  }
}

// cudaMemGetInfo makes the device's context (hundreds of MiB on every device it is asked of); the
// device's properties need none, and give the same total.
std::size_t CudaBackend::total_memory(int device) {
  check_device(device);
  std::lock_guard<std::mutex> lock(mutex_);
  std::optional<std::size_t>& total = totals_[device];
  if (!total) {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    total = prop.totalGlobalMem;
  }
  return *total;
}

// NVML names GPUs by PCI bus id (CUDA_VISIBLE_DEVICES does not apply to it). The process is listed
// only once it has a context on the device, so the first call makes it: the memory is about to be
// allocated on the device anyway (the allocator asks at a growth), and the context is part of what
// the figure must count. A failed CUDA call's error is cleared, so that torch's next check does not
// take it for its own.
std::optional<std::string> CudaBackend::bus_id_of(int device) {
  std::string bus_id;
  try {
    check_device(device);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      bus_id = bus_ids_[device];
    }
    if (bus_id.empty()) {
      DeviceScope scope(device);
      RelaxedCaptureMode relaxed;
      char text[64] = {};
      if (cudaFree(nullptr) != cudaSuccess || cudaDeviceGetPCIBusId(text, sizeof text, device) != cudaSuccess) {
        cudaGetLastError();
        return std::nullopt;
      }
      bus_id = text;
      std::lock_guard<std::mutex> lock(mutex_);
      bus_ids_[device] = bus_id;
    }
  } catch (const std::exception&) {
    cudaGetLastError();
    return std::nullopt;
  }
  return bus_id;
}

std::optional<std::size_t> CudaBackend::process_used(int device) {
  const std::optional<std::string> bus_id = bus_id_of(device);
  if (!bus_id) return std::nullopt;
  return nvml_process_memory(bus_id->c_str(), static_cast<unsigned>(getpid()));
}

std::vector<ProcessUse> CudaBackend::processes_on(int device) {
  const std::optional<std::string> bus_id = bus_id_of(device);
  if (!bus_id) return {};
  return nvml_processes(bus_id->c_str());
}

void* CudaBackend::reserve(int device, std::size_t bytes) {
  DeviceScope scope(device);
  RelaxedCaptureMode relaxed;
  void* ptr = nullptr;
  const cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clears the sticky-looking but recoverable error
    return nullptr;
  }
  check(status, "cudaMalloc");
  return ptr;
}

void CudaBackend::release(int device, void* ptr, std::size_t) {
  DeviceScope scope(device);
  check(cudaFree(ptr), "cudaFree");
}

MemInfo CudaBackend::mem_info(int device) {
  check_device(device);
  DeviceScope scope(device);
  RelaxedCaptureMode relaxed;
  MemInfo info;
  check(cudaMemGetInfo(&info.free, &info.total), "cudaMemGetInfo");
  return info;
}

// The event calls index the per-device tables, so they count the devices first (check_device) like
// every other call: a backend asked for an event before anything else must not read past them.
EventId CudaBackend::record_event(int device, StreamId stream) {
  check_device(device);
  DeviceScope scope(device);
  cudaEvent_t event = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& spare = spare_events_[device];
    if (!spare.empty()) {
      event = static_cast<cudaEvent_t>(spare.back());
      spare.pop_back();
    }
  }
  if (!event) check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaEventRecord(event, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord");
  return event;
}

bool CudaBackend::event_done(int device, EventId event) {
  DeviceScope scope(device);
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(status, "cudaEventQuery");
  return true;
}

void CudaBackend::destroy_event(int device, EventId event) {
  check_device(device);
  std::lock_guard<std::mutex> lock(mutex_);
  spare_events_[device].push_back(event);
}

void CudaBackend::synchronize(int device) {
  DeviceScope scope(device);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

void CudaBackend::synchronize_stream(int device, StreamId stream) {
  DeviceScope scope(device);
  check(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

// ---- Virtual memory ---------------------------------------------------------------------------

std::size_t CudaBackend::page_size(int device) {
  check_device(device);
  std::lock_guard<std::mutex> lock(vm_mutex_);
  std::optional<std::size_t>& page = vm_[device].page;
  if (!page) page = query_page_size(device);
  return *page;
}

std::size_t CudaBackend::mapping_page(int device) {
  const std::size_t page = page_size(device);
  if (page == 0) {
    throw std::logic_error("gpumem: CUDA device " + std::to_string(device) + " cannot map pages; page_size is 0");
  }
  return page;
}

void* CudaBackend::reserve_address(int device, std::size_t bytes) {
  // Without virtual memory the backend answers as core/backend.h's default does.
  const std::size_t page = page_size(device);
  if (page == 0) return nullptr;
  DeviceScope scope(device);
  RelaxedCaptureMode relaxed;
  CUdeviceptr addr = 0;
  const CUresult status = driver().cuMemAddressReserve(&addr, bytes, page, 0, 0);
  if (status == CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
  check_driver(status, "cuMemAddressReserve");
  return reinterpret_cast<void*>(addr);
}

void CudaBackend::release_address(int device, void* ptr, std::size_t bytes) {
  check_device(device);
  DeviceScope scope(device);
  check_driver(driver().cuMemAddressFree(reinterpret_cast<CUdeviceptr>(ptr), bytes), "cuMemAddressFree");
}

bool CudaBackend::map(int device, void* ptr, std::size_t bytes, std::size_t chunk) {
  const std::size_t page = mapping_page(device);
  if (chunk == 0 || chunk % page != 0) {
    throw std::logic_error("gpumem: map chunk of " + std::to_string(chunk) + " bytes is not whole pages of " + std::to_string(page));
  }
  const auto base = reinterpret_cast<CUdeviceptr>(ptr);
  DeviceScope scope(device);
  RelaxedCaptureMode relaxed;
  // A refusal the driver's own figure makes certain is answered at once: creating physical memory
  // up to what is free, then giving it all back, costs about what creating it does, and a refused
  // request tries up to four times (on an H100, two full processes asking each other for 15 % of
  // the device at once: 67 ms a request without this check, 1.4 ms with it; bench_sharing at_once).
  std::size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) == cudaSuccess && free < bytes) return false;
  MappedChunks chunks(driver(), device, base);
  while (chunks.bytes() < bytes) {
    if (!chunks.map_next(std::min(chunk, bytes - chunks.bytes()))) return false;
  }
  // Access is set under the lock that grant_peer takes, so a peer granted meanwhile is not missed.
  std::lock_guard<std::mutex> lock(vm_mutex_);
  VirtualMemory& vm = vm_[device];
  const CUresult access = allow_access(device, vm.peers, base, bytes);
  if (access == CUDA_ERROR_OUT_OF_MEMORY) return false;  // the chunks go with `chunks`
  check_driver(access, "cuMemSetAccess");
  vm.mapped.insert(chunks.chunks().begin(), chunks.chunks().end());
  chunks.keep();
  return true;
}

void CudaBackend::unmap(int device, void* ptr, std::size_t bytes) {
  mapping_page(device);
  std::vector<std::pair<std::uintptr_t, std::size_t>> mappings;
  {
    // Taken out first, so a grant_peer from here on does not reach memory going away.
    std::lock_guard<std::mutex> lock(vm_mutex_);
    mappings = take_mappings(vm_[device].mapped, reinterpret_cast<std::uintptr_t>(ptr), bytes);
  }
  DeviceScope scope(device);
  CUresult first = CUDA_SUCCESS;
  for (const auto& [addr, size] : mappings) {
    const CUresult status = driver().cuMemUnmap(addr, size);  // every one tried; the first failure reported
    if (first == CUDA_SUCCESS) first = status;
  }
  check_driver(first, "cuMemUnmap");
}

void CudaBackend::grant_peer(int device, int peer) {
  check_device(device);
  check_device(peer);
  if (peer == device) return;  // a device always reaches its own pages
  std::lock_guard<std::mutex> lock(vm_mutex_);
  VirtualMemory& vm = vm_[device];
  if (std::find(vm.peers.begin(), vm.peers.end(), peer) != vm.peers.end()) return;
  const CUmemAccessDesc access = read_write_for(peer);
  for (const auto& [addr, bytes] : vm.mapped) {
    check_driver(driver().cuMemSetAccess(addr, bytes, &access, 1), "cuMemSetAccess");
  }
  vm.peers.push_back(peer);
}

}  // namespace gpumem
