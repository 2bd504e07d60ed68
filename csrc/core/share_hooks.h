// What a device allocator asks of its GPU's sharing (csrc/sharing/), and nothing more, in plain
// values. The sharing keeps the ceiling the others leave this process in the cap through
// DeviceAllocator::set_shared_ceiling, from its own thread; the allocator asks it for help with no
// lock of its own held (DeviceCore::ask_neighbours), so a process never waits on another while it
// holds its device. A device that does not share has no hooks.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/backend.h"

namespace gpumem {

class ShareHooks {
 public:
  virtual ~ShareHooks() = default;
  // A request found the device full (budget_needed 0), or the shared ceiling in the way of the
  // budget it needs (`budget_needed`): refreshes the ceiling and, unless that lifts
  // it to what is needed, asks the other processes to give back free cache, waits for their
  // answers (a bounded wait), and refreshes it again. Called with no allocator lock held; the
  // request is tried once more after it. Never throws.
  virtual void ask(std::size_t budget_needed) noexcept = 0;
  // For the out-of-memory message, under the whole device (it reads memory and waits on nothing):
  // who holds how much and what could not be asked; `on_device`: the processes the driver lists on
  // the GPU (Backend::processes_on), empty where it cannot.
  virtual std::string describe(const std::vector<ProcessUse>& on_device) const noexcept = 0;
};

}  // namespace gpumem
