#include "torch/tracing_backend.h"

namespace gpumem {

namespace {
thread_local StreamId request_stream = 0;
}  // namespace

void TracingBackend::set_request_stream(StreamId stream) { request_stream = stream; }

void* TracingBackend::reserve(int device, std::size_t bytes) {
  void* ptr = inner_.reserve(device, bytes);
  if (ptr && history_.active()) {
    history_.record(History::Action::SEGMENT_ALLOC, device, reinterpret_cast<std::uintptr_t>(ptr), bytes, request_stream, {});
  }
  return ptr;
}

void TracingBackend::release(int device, void* ptr, std::size_t bytes) {
  if (history_.active()) {
    history_.record(History::Action::SEGMENT_FREE, device, reinterpret_cast<std::uintptr_t>(ptr), bytes, 0, {});
  }
  inner_.release(device, ptr, bytes);
}

bool TracingBackend::map(int device, void* ptr, std::size_t bytes) {
  const bool mapped = inner_.map(device, ptr, bytes);
  if (mapped && history_.active()) {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    history_.record(History::Action::SEGMENT_MAP, device, addr, bytes, request_stream, {});
  }
  return mapped;
}

void TracingBackend::unmap(int device, void* ptr, std::size_t bytes) {
  if (history_.active()) {
    history_.record(History::Action::SEGMENT_UNMAP, device, reinterpret_cast<std::uintptr_t>(ptr), bytes, 0, {});
  }
  inner_.unmap(device, ptr, bytes);
}

}  // namespace gpumem
