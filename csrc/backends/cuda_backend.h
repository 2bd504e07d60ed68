// The CUDA runtime as a backend: segments from cudaMalloc, stream order from CUDA events.
#pragma once

#include <mutex>
#include <vector>

#include "core/backend.h"

namespace gpumem {

class CudaBackend : public Backend {
 public:
  CudaBackend();

  int device_count() const override { return device_count_; }
  void* reserve(int device, std::size_t bytes) override;
  void release(int device, void* ptr, std::size_t bytes) override;
  MemInfo mem_info(int device) override;
  EventId record_event(int device, StreamId stream) override;
  bool event_done(int device, EventId event) override;
  void destroy_event(int device, EventId event) override;
  void synchronize(int device) override;

 private:
  int device_count_ = 0;
  std::mutex mutex_;
  std::vector<std::vector<EventId>> spare_events_;  // per device; events are reused, not recreated
};

}  // namespace gpumem
