#include "torch/pool_source.h"

#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/errors.h"

namespace gpumem {

namespace {

// A private pool's DataPtrs carry the block's address tagged in its two low bits (allocator.cpp),
// and every block starts at its segment's address plus a multiple of 512.
constexpr std::uintptr_t kAlignment = 4;

}  // namespace

void* TorchPoolSource::reserve(std::size_t bytes) {
  void* ptr = nullptr;
  context_.on_device(device_, [&] {
    try {
      ptr = allocator_->raw_alloc(bytes);
    } catch (const c10::OutOfMemoryError&) {
      ptr = nullptr;  // what native's nullptr means too: the device is full
    }
  });
  if (!ptr || reinterpret_cast<std::uintptr_t>(ptr) % kAlignment == 0) return ptr;
  context_.on_device(device_, [&] { allocator_->raw_delete(ptr); });
  throw std::runtime_error("gpumem: the MemPool's allocator returned " + std::to_string(bytes) + " bytes at " +
                           std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
                           ", an address not aligned to 4 bytes; gpumem needs aligned segments (cudaMalloc's are "
                           "aligned to 256 bytes at least)");
}

void TorchPoolSource::release(void* ptr, std::size_t bytes) {
  quietly([&] { history_.drop_frees(device_, reinterpret_cast<std::uintptr_t>(ptr), bytes); });
  context_.on_device(device_, [&] { allocator_->raw_delete(ptr); });
}

}  // namespace gpumem
