// The CUDA backend (backends/cuda_backend.h): segments, events and streams through the runtime, pages
// through the driver's virtual memory (cuda_driver.cpp), NVML's per-process figure (nvml.cpp) and
// memory shared with other processes. A paused region's backups are cuda_backups.cpp's, what a
// graph capture says of stream order cuda_capture.cpp's.
#include "backends/cuda_backend.h"

#include <cuda_runtime_api.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <iterator>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda_calls.h"
#include "backends/cuda_driver.h"
#include "backends/nvml.h"
#include "core/errors.h"

namespace gpumem {

using cuda_calls::check;
using cuda_calls::DeviceScope;

namespace {

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

// Whether the device can make memory exportable as POSIX file descriptors (CUDA IPC of growable
// segments). Never throws: where it cannot say, no.
bool exports_descriptors(int device) {
  const DriverApi* api = find_driver();
  CUdevice handle = 0;
  int supported = 0;
  if (!api || api->cuDeviceGet(&handle, device) != CUDA_SUCCESS) return false;
  const CUdevice_attribute posix = CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
  return api->cuDeviceGetAttribute(&supported, posix, handle) == CUDA_SUCCESS && supported == 1;
}

// The physical allocations one map() call has mapped so far, each a mapping of its own. Unless
// kept they are unmapped when it goes, so a map() that runs out of memory part way, or throws,
// leaves nothing mapped.
class MappedChunks {
 public:
  MappedChunks(const DriverApi& api, const CUmemAllocationProp& prop, CUdeviceptr base) : api_(api), prop_(prop), base_(base) {}
  ~MappedChunks() {
    if (kept_) return;
    for (const auto& [addr, bytes] : chunks_) api_.cuMemUnmap(addr, bytes);  // best effort: a destructor cannot throw
  }
  MappedChunks(const MappedChunks&) = delete;
  MappedChunks& operator=(const MappedChunks&) = delete;

  std::size_t bytes() const { return bytes_; }
  const std::vector<std::pair<std::uintptr_t, std::size_t>>& chunks() const { return chunks_; }
  void keep() { kept_ = true; }
  // Whether the chunks made are exportable: false once the driver refused an exportable one and
  // the rest were made without.
  bool exportable() const { return prop_.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE; }

  // Backs the next `bytes` with one new allocation; false when the device has no memory for it.
  bool map_next(std::size_t bytes) {
    CUmemGenericAllocationHandle handle = 0;
    const CUresult created = create(&handle, bytes);
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
  CUmemAllocationProp prop_;
  const CUdeviceptr base_;
  std::size_t bytes_ = 0;
  std::vector<std::pair<std::uintptr_t, std::size_t>> chunks_;
  bool kept_ = false;

  // An exportable allocation where asked, else (the driver refusing that kind, as some containers
  // and drivers do) a plain one, and plain ones from then on.
  CUresult create(CUmemGenericAllocationHandle* handle, std::size_t bytes) {
    CUresult status = api_.cuMemCreate(handle, bytes, &prop_, 0);
    if (status != CUDA_SUCCESS && status != CUDA_ERROR_OUT_OF_MEMORY && exportable()) {
      prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
      status = api_.cuMemCreate(handle, bytes, &prop_, 0);
    }
    return status;
  }
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
  CUmemAllocationProp prop = pinned_on(device);
  {
    std::lock_guard<std::mutex> lock(vm_mutex_);
    std::optional<bool>& exportable = vm_[device].exportable;
    if (!exportable) exportable = exports_descriptors(device);
    if (*exportable) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  }
  MappedChunks chunks(driver(), prop, base);
  while (chunks.bytes() < bytes) {
    if (!chunks.map_next(std::min(chunk, bytes - chunks.bytes()))) return false;
  }
  // Access is set under the lock that grant_peer takes, so a peer granted meanwhile is not missed.
  std::lock_guard<std::mutex> lock(vm_mutex_);
  VirtualMemory& vm = vm_[device];
  const CUresult access = allow_access(device, vm.peers, base, bytes);
  if (access == CUDA_ERROR_OUT_OF_MEMORY) return false;  // the chunks go with `chunks`
  check_driver(access, "cuMemSetAccess");
  if (!chunks.exportable()) vm.exportable = false;
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
    VirtualMemory& vm = vm_[device];
    mappings = take_mappings(vm.mapped, reinterpret_cast<std::uintptr_t>(ptr), bytes);
    // Descriptors of exported chunks go with them (a receiver that imported one keeps its own).
    for (const auto& mapping : mappings) {
      const auto fd = vm.exported.find(mapping.first);
      if (fd == vm.exported.end()) continue;
      close(fd->second);
      vm.exported.erase(fd);
    }
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

// ---- Sharing with other processes ------------------------------------------------------------

std::string CudaBackend::export_segment(int device, void* base) {
  DeviceScope scope(device);
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, base), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void* CudaBackend::open_segment(int device, const std::string& handle) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h)) throw std::invalid_argument("gpumem: a CUDA IPC memory handle of " + std::to_string(handle.size()) + " bytes; expected 64");
  std::memcpy(&h, handle.data(), sizeof(h));
  DeviceScope scope(device);
  void* ptr = nullptr;
  check(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return ptr;
}

void CudaBackend::close_segment(int device, void* ptr) {
  DeviceScope scope(device);
  check(cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle");
}

std::vector<int> CudaBackend::export_chunks(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& chunks) {
  mapping_page(device);
  std::lock_guard<std::mutex> lock(vm_mutex_);
  VirtualMemory& vm = vm_[device];
  std::vector<int> fds;
  for (const auto& [addr, bytes] : chunks) {
    const auto mapping = vm.mapped.find(addr);
    if (mapping == vm.mapped.end() || mapping->second != bytes) {
      throw std::logic_error("gpumem: export of " + std::to_string(bytes) + " bytes at " + std::to_string(addr) + " is not one mapping of map()");
    }
    if (const auto open = vm.exported.find(addr); open != vm.exported.end()) {
      fds.push_back(open->second);
      continue;
    }
    CUmemGenericAllocationHandle handle = 0;
    check_driver(driver().cuMemRetainAllocationHandle(&handle, reinterpret_cast<void*>(addr)), "cuMemRetainAllocationHandle");
    int fd = -1;
    const CUresult exported = driver().cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    driver().cuMemRelease(handle);  // the retain's reference; the mapping keeps the memory
    if (exported != CUDA_SUCCESS) {
      const char* text = nullptr;
      driver().cuGetErrorString(exported, &text);
      throw std::runtime_error(std::string("gpumem: this process's growable memory cannot be exported to another process "
                                           "(cuMemExportToShareableHandle: ") + (text ? text : "unknown error") +
                               "): the device or driver made it without file descriptor handles. Send from a process "
                               "with plain segments (GPUMEM_SEGMENTS=plain)");
    }
    vm.exported.emplace(addr, fd);
    fds.push_back(fd);
  }
  return fds;
}

namespace {

// The descriptor `fd` of process `pid`, as a descriptor of this process (pidfd_getfd: the same
// user, and ptrace access to the sender). Throws naming the call, the cause and what to do.
class SenderFds {
 public:
  explicit SenderFds(int pid) : pid_(pid) {
    pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (pidfd_ < 0) fail("pidfd_open", errno);
  }
  ~SenderFds() { close(pidfd_); }
  SenderFds(const SenderFds&) = delete;
  SenderFds& operator=(const SenderFds&) = delete;

  int take(int fd) const {
    const int mine = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd_, fd, 0));
    if (mine < 0) fail("pidfd_getfd", errno);
    return mine;
  }

 private:
  [[noreturn]] void fail(const char* call, int error) const {
    std::string why = std::strerror(error);
    if (error == ENOSYS) why = "this kernel has no such call (Linux 5.6 or later has it)";
    if (error == EPERM) why += ": the sender runs as another user, or ptrace is restricted (kernel.yama.ptrace_scope, a container's seccomp)";
    if (error == ESRCH) why += ": the sending process has exited";
    throw std::runtime_error(std::string("gpumem: cannot take growable memory from process ") + std::to_string(pid_) + ": " +
                             call + " failed: " + why);
  }
  int pid_;
  int pidfd_ = -1;
};

}  // namespace

void* CudaBackend::open_chunks(int device, int pid, const std::vector<int>& fds, const std::vector<std::size_t>& bytes) {
  const std::size_t page = mapping_page(device);
  if (fds.empty() || fds.size() != bytes.size()) throw std::invalid_argument("gpumem: open_chunks needs one size per descriptor");
  std::size_t total = 0;
  for (const std::size_t b : bytes) {
    if (b == 0 || b % page != 0) throw std::invalid_argument("gpumem: a shared chunk of " + std::to_string(b) + " bytes is not whole pages of " + std::to_string(page));
    total += b;
  }
  const SenderFds sender(pid);
  DeviceScope scope(device);
  CUdeviceptr base = 0;
  check_driver(driver().cuMemAddressReserve(&base, total, page, 0, 0), "cuMemAddressReserve");
  std::size_t mapped = 0;
  try {
    for (std::size_t i = 0; i < fds.size(); ++i) {
      const int fd = sender.take(fds[i]);
      CUmemGenericAllocationHandle handle = 0;
      const CUresult imported = driver().cuMemImportFromShareableHandle(
          &handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      close(fd);
      check_driver(imported, "cuMemImportFromShareableHandle");
      const CUresult status = driver().cuMemMap(base + mapped, bytes[i], 0, handle, 0);
      driver().cuMemRelease(handle);  // the mapping keeps the memory
      check_driver(status, "cuMemMap");
      mapped += bytes[i];
    }
    std::vector<int> peers;
    {
      std::lock_guard<std::mutex> lock(vm_mutex_);
      peers = vm_[device].peers;
    }
    check_driver(allow_access(device, peers, base, total), "cuMemSetAccess");
  } catch (...) {
    std::size_t at = 0;
    for (std::size_t i = 0; i < fds.size() && at < mapped; at += bytes[i], ++i) driver().cuMemUnmap(base + at, bytes[i]);
    driver().cuMemAddressFree(base, total);
    throw;
  }
  return reinterpret_cast<void*>(base);
}

void CudaBackend::close_chunks(int device, void* ptr, const std::vector<std::size_t>& bytes) {
  DeviceScope scope(device);
  // Work queued on the memory may still run: the receiver's storages synchronized their stream,
  // not every stream.
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const auto base = reinterpret_cast<CUdeviceptr>(ptr);
  std::size_t at = 0;
  CUresult first = CUDA_SUCCESS;
  for (const std::size_t b : bytes) {
    const CUresult status = driver().cuMemUnmap(base + at, b);
    if (first == CUDA_SUCCESS) first = status;
    at += b;
  }
  check_driver(first, "cuMemUnmap");
  check_driver(driver().cuMemAddressFree(base, at), "cuMemAddressFree");
}

}  // namespace gpumem
