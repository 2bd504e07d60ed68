// What a device allocator asks of its GPU's sharing (csrc/sharing/), and nothing more, in plain
// values. The sharing keeps the ceiling the others leave this process in the cap through
// DeviceAllocator::set_shared_ceiling, from its own thread; the allocator asks it for help with no
// lock of its own held (DeviceCore::ask_neighbours), so a process never waits on another while it
// holds its device. A device that does not share has no hooks.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "core/backend.h"

namespace gpumem {

// What a request asks the others for.
struct AskFor {
  std::size_t budget_needed = 0;  // only the shared ceiling refused: the budget the request needs
  std::size_t device_bytes = 0;   // the device refused: the bytes the request's growth needs of it
};

// While the others give memory back, the request maps what the device holds for it so far (Note
// [mapping while the others release], core/growable_segments.cpp) and says what it still lacks on the
// device: 0 once it can be served. Called with no allocator lock held; takes the whole device itself.
using StillNeeded = std::function<std::size_t()>;

class ShareHooks {
 public:
  virtual ~ShareHooks() = default;
  // A request found the device full (need.device_bytes), or the shared ceiling in the way of the
  // budget it needs (need.budget_needed): refreshes the ceiling and, unless that lifts it to what
  // is needed, asks the other processes to give back free cache (for a device refusal, what the
  // device lacks, largest cached blocks first), and waits a bounded time for their answers or for
  // `still_needed` to report 0, calling it as memory comes back. Called with no allocator lock
  // held; the request is tried once more after it. Never throws.
  virtual void ask(const AskFor& need, const StillNeeded& still_needed) noexcept = 0;
  // For the out-of-memory message, under the whole device (it reads memory and waits on nothing):
  // who holds how much and what could not be asked; `on_device`: the processes the driver lists on
  // the GPU (Backend::processes_on), empty where it cannot.
  virtual std::string describe(const std::vector<ProcessUse>& on_device) const noexcept = 0;
};

}  // namespace gpumem
