// What the parts of one device share (core/device_state.h): made together, in the order they depend on.
#include "core/device_state.h"

namespace gpumem {

DeviceState::DeviceState(Backend& backend, int device, DeviceAllocator* owner)
    : backend(backend),
      device(device),
      owner(owner),
      backend_source(backend, device),
      pools(device), segments(device, owner) {}

}  // namespace gpumem
