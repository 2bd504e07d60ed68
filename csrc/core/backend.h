// The only way the core reaches memory. A backend hands out segments and orders work on streams;
// it knows nothing of blocks, pools or limits. Two implementations: the CUDA runtime
// (backends/cuda_backend.h) and a simulated device (backends/sim_backend.h) that never touches
// memory, so the whole allocator runs and is tested on a machine without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpumem {

// A stream as the backend knows it (cudaStream_t in the CUDA backend). 0 is the default stream.
using StreamId = std::uintptr_t;

// An event recorded on a stream; completes once the work queued before it has run.
using EventId = void*;

struct MemInfo {
  std::size_t free = 0;
  std::size_t total = 0;
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

  // Stream ordering, for reusing a block freed while another stream may still read it.
  virtual EventId record_event(int device, StreamId stream) = 0;
  virtual bool event_done(int device, EventId event) = 0;
  virtual void destroy_event(int device, EventId event) = 0;
  // Waits for all work on the device.
  virtual void synchronize(int device) = 0;
};

}  // namespace gpumem
