#include "torch/tracing_backend.h"

#include "core/errors.h"

namespace gpumem {

namespace {

struct RequestState {
  StreamId stream = 0;
  History::Context context;
};
thread_local RequestState request;

}  // namespace

TracingBackend::Request::Request(StreamId stream, History::Context context) {
  request.stream = stream;
  request.context = std::move(context);
}

TracingBackend::Request::~Request() {
  request.stream = 0;
  request.context = nullptr;
}

// What the history is told must not fail the memory operation it describes (quietly): the device
// has handed the memory out (or taken it back) already, and the core's rollback would lose count.
// Segments remember the stack of the request that made them; a release carries the request's
// stack (empty_cache's, when recording keeps freeing stacks) or else the one that made it.
void* TracingBackend::reserve(int device, std::size_t bytes) {
  void* ptr = inner_.reserve(device, bytes);
  if (ptr && history_.active()) {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    quietly([&] {
      history_.record(History::Action::SEGMENT_ALLOC, device, addr, bytes, request.stream, {}, request.context);
      history_.remember(History::kSegments, device, addr, request.context);
    });
  }
  return ptr;
}

void TracingBackend::release(int device, void* ptr, std::size_t bytes) {
  if (history_.active()) {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    quietly([&] {
      History::Context made = history_.forget(History::kSegments, device, addr);
      history_.drop_frees(device, addr, bytes);
      history_.record(History::Action::SEGMENT_FREE, device, addr, bytes, request.stream, {},
                      request.context ? request.context : made);
    });
  }
  inner_.release(device, ptr, bytes);
}

bool TracingBackend::map(int device, void* ptr, std::size_t bytes, std::size_t chunk) {
  const bool mapped = inner_.map(device, ptr, bytes, chunk);
  if (mapped && history_.active()) {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    quietly([&] {
      history_.record(History::Action::SEGMENT_MAP, device, addr, bytes, request.stream, {}, request.context);
      history_.remember(History::kSegments, device, addr, request.context);
    });
  }
  return mapped;
}

void TracingBackend::unmap(int device, void* ptr, std::size_t bytes) {
  if (history_.active()) {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    quietly([&] {
      History::Context made = history_.forget(History::kSegments, device, addr);
      history_.drop_frees(device, addr, bytes);
      history_.record(History::Action::SEGMENT_UNMAP, device, addr, bytes, request.stream, {},
                      request.context ? request.context : made);
    });
  }
  inner_.unmap(device, ptr, bytes);
}

}  // namespace gpumem
