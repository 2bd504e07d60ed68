// The CUDA runtime as a backend: segments from cudaMalloc, stream order from CUDA events, and
// growable segments from the driver's virtual memory calls (backends/cuda_driver.h), where the
// driver has them.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.h"

namespace gpumem {

class CudaBackend : public Backend {
 public:

  int device_count() const override;  // counted on first ask: see Note [no CUDA before first use]
  void* reserve(int device, std::size_t bytes) override;
  void release(int device, void* ptr, std::size_t bytes) override;
  MemInfo mem_info(int device) override;
  std::size_t total_memory(int device) override;
  // NVML's per-process figure (backends/nvml.h) for this pid. The first call on a device makes its
  // context (the process is listed only then); later calls make no CUDA call at all, so they are
  // safe while a graph captures.
  std::optional<std::size_t> process_used(int device) override;
  std::vector<ProcessUse> processes_on(int device) override;
  EventId record_event(int device, StreamId stream) override;
  bool event_done(int device, EventId event) override;
  void destroy_event(int device, EventId event) override;
  void synchronize(int device) override;
  void synchronize_stream(int device, StreamId stream) override;

  // Virtual memory, as core/backend.h specifies it. Each map() call is one physical allocation and
  // one mapping, so an unmap() gives back whole ones (the driver unmaps only whole mappings).
  std::size_t page_size(int device) override;
  void* reserve_address(int device, std::size_t bytes) override;
  void release_address(int device, void* ptr, std::size_t bytes) override;
  bool map(int device, void* ptr, std::size_t bytes, std::size_t chunk) override;
  void unmap(int device, void* ptr, std::size_t bytes) override;
  void grant_peer(int device, int peer) override;

  // A paused region's backup: host memory per range, mapped and pinned (cudaHostRegister) in pieces
  // by several threads while the copies of the pieces pinned already run, queued in pieces on two
  // streams of their own and waited for (backends/cuda_backups.cpp).
  void back_up(int device, std::vector<HostCopy>& copies) override;
  void allocate_backup(int device, std::vector<HostCopy>& copies) override;
  void restore(int device, const std::vector<HostCopy>& copies) override;
  void drop_backup(int device, std::vector<HostCopy>& copies) noexcept override;

  // Stream capture (backends/cuda_capture.cpp): a marker is an empty node added to the capture
  // graph after the stream's work so far, which the stream's later work then depends on.
  CaptureMarker capture_marker(int device, StreamId stream) override;
  bool capture_follows(int device, StreamId stream, CaptureMarker marker) override;

  // Sharing with other processes: plain segments through cudaIpcGetMemHandle and
  // cudaIpcOpenMemHandle; growable chunks as POSIX file descriptors (the chunks are made
  // exportable where the device allows it), which a receiver of the same user takes with
  // pidfd_getfd. An exported chunk's descriptor stays open until the chunk is unmapped.
  std::string export_segment(int device, void* base) override;
  void* open_segment(int device, const std::string& handle) override;
  void close_segment(int device, void* ptr) override;
  std::vector<int> export_chunks(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& chunks) override;
  void* open_chunks(int device, int pid, const std::vector<int>& fds, const std::vector<std::size_t>& bytes) override;
  void close_chunks(int device, void* ptr, const std::vector<std::size_t>& bytes) override;

 private:
  // What virtual memory keeps per device. grant_peer must reach the pages mapped before it, so the
  // backend knows what is mapped: one range per map() call, each a mapping of its own. Ranges are
  // never merged: unmap() needs each mapping's bounds, and neighbours may lie in different reserved
  // ranges, which one cuMemSetAccess must not span.
  // Invariant: ranges in `mapped` never overlap; each lies inside one reserved range.
  struct VirtualMemory {
    std::optional<std::size_t> page;               // the granularity, once asked; 0: none
    std::vector<int> peers;                        // granted so far
    std::map<std::uintptr_t, std::size_t> mapped;  // address -> bytes
    std::optional<bool> exportable;                // chunks made as POSIX descriptors can export them; once asked
    std::map<std::uintptr_t, int> exported;        // a mapping's address -> its open descriptor (export_chunks)
  };

  void check_device(int device) const;
  std::size_t mapping_page(int device);  // page_size, throwing where there is none

  // Sized when the devices are counted (device_count()); until then empty.
  mutable std::once_flag counted_;
  mutable int device_count_ = 0;
  std::mutex mutex_;                                             // guards spare_events_, totals_
  mutable std::vector<std::vector<EventId>> spare_events_;       // per device; events are reused
  mutable std::vector<std::optional<std::size_t>> totals_;       // per device, once asked
  // The device's PCI bus id, as NVML names GPUs; made with its context on first ask. Never throws.
  std::optional<std::string> bus_id_of(int device);
  mutable std::vector<std::string> bus_ids_;  // per device: its PCI bus id once its context is made (process_used)
  std::mutex vm_mutex_;                                          // guards vm_
  mutable std::vector<VirtualMemory> vm_;                        // per device
};

}  // namespace gpumem
