// What a device allocator asks of its GPU's sharing (core/share_client.h), and nothing more: two
// calls, both made under the whole device. A device that does not share has no hooks.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/backend.h"

namespace gpumem {

struct DeviceState;

class ShareHooks {
 public:
  virtual ~ShareHooks() = default;
  // A request of `size` bytes needs new memory while `allocated` bytes are live: refresh the
  // shared ceiling; where only the ceiling (not the hard cap) stands in the way, first ask the
  // others for fresh figures and their free cache. Never throws.
  virtual void before_growth(DeviceState& d, std::size_t allocated, std::size_t size) noexcept = 0;
  // The device refused new memory and the fallback chain could not serve: ask the others to give
  // back free cache; true if the request is worth trying again. Never throws.
  virtual bool retry_after_refusal(DeviceState& d) noexcept = 0;
  // For the out-of-memory message: who holds how much, and what could not be asked; `on_device`:
  // the processes the driver lists on the GPU (Backend::processes_on), empty where it cannot.
  virtual std::string describe(const std::vector<ProcessUse>& on_device) const noexcept = 0;
};

}  // namespace gpumem
