// The only way the core reaches memory. A backend hands out segments and orders work on streams;
// it knows nothing of blocks, pools or limits. Two implementations: the CUDA runtime
// (backends/cuda_backend.h) and a simulated device (backends/sim_backend.h) that never touches
// memory, so the whole allocator runs and is tested on a machine without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gpumem {

// One process the driver lists on a device, and the bytes it holds there.
struct ProcessUse {
  std::uint32_t pid = 0;
  std::size_t bytes = 0;
};

// A stream as the backend knows it (cudaStream_t in the CUDA backend). 0 is the default stream.
using StreamId = std::uintptr_t;

// An event recorded on a stream; completes once the work queued before it has run.
using EventId = void*;

// A point in the work a stream queues while a CUDA graph captures it; 0 is no marker.
using CaptureMarker = std::uintptr_t;

struct MemInfo {
  std::size_t free = 0;
  std::size_t total = 0;
};

// A range of device memory and its copy in host memory (Backend::back_up): at `offset` in the host
// memory `host`, which a backup of a larger range may hold (a range paused inside memory a region
// prepared or kept whole; 0 where the copy is the whole of it).
struct HostCopy {
  std::uintptr_t device_addr = 0;
  std::size_t bytes = 0;
  void* host = nullptr;
  std::size_t offset = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual int device_count() const = 0;

  // A segment of exactly `bytes` on `device`, or nullptr when the device has no memory for it.
  // Other failures (a broken driver, a bad device) throw.
  virtual void* reserve(int device, std::size_t bytes) = 0;
  virtual void release(int device, void* ptr, std::size_t bytes) = 0;

  virtual MemInfo mem_info(int device) = 0;
  // The device's memory in bytes, as mem_info's total, where that can be had more cheaply (CUDA:
  // without making the device's context).
  virtual std::size_t total_memory(int device) { return mem_info(device).total; }

  // What the driver counts for this process on `device`, in bytes (NVML's per-process accounting
  // in the CUDA backend), or nullopt where that cannot be had: no such accounting, or the driver
  // does not list this process (a container's own pid namespace). Never throws.
  virtual std::optional<std::size_t> process_used(int /*device*/) { return std::nullopt; }
  // Every process the driver lists on `device` with what it holds there (NVML in the CUDA
  // backend; pids as the driver sees them, which in a container are the host's), empty where that
  // cannot be had. For the out-of-memory message only. Never throws.
  virtual std::vector<ProcessUse> processes_on(int /*device*/) { return {}; }

  // Stream ordering, for reusing a block freed while another stream may still read it.
  virtual EventId record_event(int device, StreamId stream) = 0;
  virtual bool event_done(int device, EventId event) = 0;
  virtual void destroy_event(int device, EventId event) = 0;
  // Waits for all work on the device.
  virtual void synchronize(int device) = 0;
  // Waits for the work queued on one stream so far.
  virtual void synchronize_stream(int device, StreamId stream) = 0;

  // ---- Virtual memory, for growable segments (see core/growable_segments.cpp) ----
  // A backend without it keeps these defaults: page_size 0 means "not supported", and the
  // allocator then uses plain segments only.

  // The mapping granularity on `device` in bytes (a power of two), or 0 if the device cannot map
  // physical pages into reserved address ranges.
  virtual std::size_t page_size(int /*device*/) { return 0; }
  // An address range of `bytes` (a multiple of the page size), aligned to the page size, with no
  // memory behind it; nullptr when no range can be had. Other failures throw.
  virtual void* reserve_address(int /*device*/, std::size_t /*bytes*/) { return nullptr; }
  // Gives back a range reserve_address returned; none of its pages is mapped.
  virtual void release_address(int /*device*/, void* /*ptr*/, std::size_t /*bytes*/) {}
  // Backs [ptr, ptr + bytes) (page-aligned, inside a reserved range, not mapped) with new physical
  // allocations of `chunk` bytes each (a multiple of the page; the last one may be smaller),
  // readable and writable by `device` and by every peer granted so far. False when the device has
  // no memory for them; then nothing of the range stays mapped. Other failures throw.
  virtual bool map(int /*device*/, void* /*ptr*/, std::size_t /*bytes*/, std::size_t /*chunk*/) { return false; }
  // Returns the memory of [ptr, ptr + bytes) to the device: whole allocations that map calls made,
  // one after the other (a driver unmaps only whole mappings). The caller has synchronized the
  // device: no queued work touches them.
  virtual void unmap(int /*device*/, void* /*ptr*/, std::size_t /*bytes*/) {}
  // From now on `peer` may access every page mapped on `device`, those mapped already included.
  virtual void grant_peer(int /*device*/, int /*peer*/) {}

  // ---- Backups of a paused region (core/pause.cpp) ----
  // Copies each range [device_addr, device_addr + bytes) to host memory the device copies to at
  // full speed (pinned): `host` at `offset`, which it allocates where null (whole: offset 0; host
  // memory kept or prepared earlier is reused); all done when it returns. On a throw it has freed
  // what it allocated in this call (those `host` null again).
  virtual void back_up(int /*device*/, std::vector<HostCopy>& /*copies*/) { throw no_backup(); }
  // Allocates that host memory for each range whose `host` is null, as back_up would, and copies
  // nothing: a later back_up into it copies at full speed. On a throw it has freed what it
  // allocated in this call.
  virtual void allocate_backup(int /*device*/, std::vector<HostCopy>& /*copies*/) { throw no_backup(); }
  // Copies each back to its range (mapped again at the same address); all done when it returns.
  virtual void restore(int /*device*/, const std::vector<HostCopy>& /*copies*/) { throw no_backup(); }
  // Frees the host memory back_up or allocate_backup allocated (each whole range's `host` null again).
  virtual void drop_backup(int /*device*/, std::vector<HostCopy>& /*copies*/) noexcept {}

  // ---- Stream capture, for reusing a block freed during a capture (core/capture_reuse.cpp) ----
  // Events cannot be queried while a graph captures, so a block freed then while other streams
  // used it waits for the capture to end, unless the backend can tell from the graph itself.
  // A backend that cannot keeps these defaults.

  // Marks the work queued so far on `stream`, which is being captured; 0 if it cannot.
  virtual CaptureMarker capture_marker(int /*device*/, StreamId /*stream*/) { return 0; }
  // Whether everything `stream` queues from now on runs after the work `marker` marked (the
  // capture has joined that work into `stream`).
  virtual bool capture_follows(int /*device*/, StreamId /*stream*/, CaptureMarker /*marker*/) { return false; }

  // ---- Sharing memory with other processes (CUDA IPC: torch/ipc.cpp) ----
  // The core never calls these: the torch adapter does, for tensors sent to or received from
  // another process. A backend that cannot share keeps these defaults, which throw
  // std::runtime_error saying so. Failures throw std::runtime_error naming the call and the cause.

  // An opaque handle (64 bytes) another process opens to map the plain segment that starts at
  // `base` (one reserve() call's memory).
  virtual std::string export_segment(int /*device*/, void* /*base*/) { throw no_sharing("export_segment"); }
  // Maps, in this process, the plain segment another process exported as `handle`; its address
  // here. Opening the same handle twice in one process fails: the caller keeps what it opened.
  virtual void* open_segment(int /*device*/, const std::string& /*handle*/) { throw no_sharing("open_segment"); }
  virtual void close_segment(int /*device*/, void* /*ptr*/) { throw no_sharing("close_segment"); }
  // The chunks [addr, addr + bytes) (each one map() call's physical allocation, whole) as another
  // process imports them: one file descriptor number of this process per chunk, open until the
  // chunk is unmapped (a receiver takes its own copy with pidfd_getfd meanwhile).
  virtual std::vector<int> export_chunks(int /*device*/, const std::vector<std::pair<std::uintptr_t, std::size_t>>& /*chunks*/) {
    throw no_sharing("export_chunks");
  }
  // Imports the chunks process `pid` exported (its descriptor numbers, each chunk's bytes) and maps
  // them one after the other in a new address range, readable and writable by `device`; the
  // range's start. close_chunks unmaps and frees it (`bytes`, the chunks' sizes, in order).
  virtual void* open_chunks(int /*device*/, int /*pid*/, const std::vector<int>& /*fds*/, const std::vector<std::size_t>& /*bytes*/) {
    throw no_sharing("open_chunks");
  }
  virtual void close_chunks(int /*device*/, void* /*ptr*/, const std::vector<std::size_t>& /*bytes*/) { throw no_sharing("close_chunks"); }

 private:
  static std::runtime_error no_backup() {
    return std::runtime_error("gpumem: this backend cannot copy device memory to the host (a paused region's backup)");
  }
  static std::runtime_error no_sharing(const char* call) {
    return std::runtime_error(std::string("gpumem: this backend cannot share memory with other processes (") + call + ")");
  }
};

// A backend that passes every call to another, for one that watches some of them (the torch
// adapter's TracingBackend) to override only those. Every call of Backend is passed on here, so a
// call added to Backend is added here too: one left out would reach Backend's default (which
// refuses, or answers as a backend without the feature) instead of the real backend.
class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(Backend& inner) : inner_(inner) {}

  int device_count() const override { return inner_.device_count(); }
  void* reserve(int device, std::size_t bytes) override { return inner_.reserve(device, bytes); }
  void release(int device, void* ptr, std::size_t bytes) override { inner_.release(device, ptr, bytes); }
  MemInfo mem_info(int device) override { return inner_.mem_info(device); }
  std::size_t total_memory(int device) override { return inner_.total_memory(device); }
  std::optional<std::size_t> process_used(int device) override { return inner_.process_used(device); }
  std::vector<ProcessUse> processes_on(int device) override { return inner_.processes_on(device); }
  EventId record_event(int device, StreamId stream) override { return inner_.record_event(device, stream); }
  bool event_done(int device, EventId event) override { return inner_.event_done(device, event); }
  void destroy_event(int device, EventId event) override { inner_.destroy_event(device, event); }
  void synchronize(int device) override { inner_.synchronize(device); }
  void synchronize_stream(int device, StreamId stream) override { inner_.synchronize_stream(device, stream); }

  std::size_t page_size(int device) override { return inner_.page_size(device); }
  void* reserve_address(int device, std::size_t bytes) override { return inner_.reserve_address(device, bytes); }
  void release_address(int device, void* ptr, std::size_t bytes) override { inner_.release_address(device, ptr, bytes); }
  bool map(int device, void* ptr, std::size_t bytes, std::size_t chunk) override { return inner_.map(device, ptr, bytes, chunk); }
  void unmap(int device, void* ptr, std::size_t bytes) override { inner_.unmap(device, ptr, bytes); }
  void grant_peer(int device, int peer) override { inner_.grant_peer(device, peer); }

  void back_up(int device, std::vector<HostCopy>& copies) override { inner_.back_up(device, copies); }
  void allocate_backup(int device, std::vector<HostCopy>& copies) override { inner_.allocate_backup(device, copies); }
  void restore(int device, const std::vector<HostCopy>& copies) override { inner_.restore(device, copies); }
  void drop_backup(int device, std::vector<HostCopy>& copies) noexcept override { inner_.drop_backup(device, copies); }

  CaptureMarker capture_marker(int device, StreamId stream) override { return inner_.capture_marker(device, stream); }
  bool capture_follows(int device, StreamId stream, CaptureMarker marker) override {
    return inner_.capture_follows(device, stream, marker);
  }

  std::string export_segment(int device, void* base) override { return inner_.export_segment(device, base); }
  void* open_segment(int device, const std::string& handle) override { return inner_.open_segment(device, handle); }
  void close_segment(int device, void* ptr) override { inner_.close_segment(device, ptr); }
  std::vector<int> export_chunks(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& chunks) override {
    return inner_.export_chunks(device, chunks);
  }
  void* open_chunks(int device, int pid, const std::vector<int>& fds, const std::vector<std::size_t>& bytes) override {
    return inner_.open_chunks(device, pid, fds, bytes);
  }
  void close_chunks(int device, void* ptr, const std::vector<std::size_t>& bytes) override { inner_.close_chunks(device, ptr, bytes); }

 protected:
  Backend& inner_;
};

}  // namespace gpumem
