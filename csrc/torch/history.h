// The allocation history behind torch.cuda.memory._record_memory_history and _dump_snapshot.
//
// One bounded ring of torch TraceEntry per device (oldest overwritten first), plus the trace
// trackers torch attaches (attachAllocatorTraceTracker), which see every entry whether or not the
// ring records. Nothing here runs on the allocation path unless active() says so: one relaxed
// atomic load per allocate and free when history and trackers are off.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/block.h"
#include "torch/compat.h"

namespace gpumem {

class History {
 public:
  using Action = torch_compat::TorchTraceEntry::Action;
  using CreateContextFn = c10::cuda::CUDACachingAllocator::CreateContextFn;
  using RecordContext = c10::cuda::CUDACachingAllocator::RecordContext;
  using Tracker = c10::cuda::CUDACachingAllocator::AllocatorTraceTracker;

  explicit History(int devices);
  ~History();
  History(const History&) = delete;
  History& operator=(const History&) = delete;

  // Recording or tracking: the allocation path must report its events.
  bool active() const { return active_.load(std::memory_order_relaxed); }
  // True while some History in the process is active: the DataPtr deleter, a plain function with
  // no adapter at hand, checks this before looking for its adapter.
  static bool any_active() { return active_count_.load(std::memory_order_relaxed) > 0; }

  // recordHistory's arguments. Disabling keeps the recorded entries; `clear` drops them.
  void configure(bool enabled, CreateContextFn recorder, std::size_t max_entries, RecordContext when, bool clear,
                 const std::vector<std::string>& skip_actions);
  bool enabled() const;
  void attach_tracker(Tracker tracker);
  // Stops recording and drops the trackers: the owner is shutting down, and what it releases
  // then is no event of the program's.
  void stop();

  void record(Action action, int device, std::uintptr_t addr, std::size_t size, StreamId stream, PoolId pool);

  // Entries per device, oldest first, times in microseconds since the epoch.
  std::vector<std::vector<torch_compat::TorchTraceEntry>> traces() const;

 private:
  struct Ring {
    std::vector<torch_compat::TorchTraceEntry> entries;
    std::size_t next = 0;  // where the next entry goes once the ring is full
  };
  static constexpr int kActions = static_cast<int>(Action::OOM) + 1;

  void set_active_locked(bool active);
  bool wants_context(Action action) const;

  mutable std::mutex mutex_;
  std::atomic<bool> active_{false};
  bool enabled_ = false;
  CreateContextFn recorder_ = nullptr;
  RecordContext when_ = RecordContext::NEVER;
  std::size_t max_entries_ = 0;
  bool skip_[kActions] = {};
  std::vector<Ring> rings_;
  std::vector<Tracker> trackers_;

  static std::atomic<int> active_count_;
};

}  // namespace gpumem
