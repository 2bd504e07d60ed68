#include "backends/sim_backend.h"

#include <string>

#include "core/errors.h"

namespace gpumem {

namespace {
// Each device's fake addresses start at its own terabyte-aligned base, far from real memory.
constexpr std::uintptr_t kDeviceSpan = std::uintptr_t{1} << 44;
}  // namespace

SimBackend::SimBackend(std::size_t capacity, int devices) : capacity_(capacity), devices_(devices) {
  for (int i = 0; i < devices; ++i) {
    devices_[i].base = kDeviceSpan * static_cast<std::uintptr_t>(i + 1);
    devices_[i].next = devices_[i].base;
  }
}

SimBackend::Device& SimBackend::device_locked(int device) {
  if (device < 0 || device >= static_cast<int>(devices_.size())) {
    throw DeviceError("gpumem: simulated device " + std::to_string(device) + " does not exist; devices are 0.." +
                      std::to_string(static_cast<int>(devices_.size()) - 1));
  }
  return devices_[device];
}

const SimBackend::Device& SimBackend::device_locked(int device) const {
  return const_cast<SimBackend*>(this)->device_locked(device);
}

bool SimBackend::should_fail(int device, std::size_t bytes) {
  if (fail_next_ > 0) {
    --fail_next_;
    return true;
  }
  if (fail_predicate_ && fail_predicate_(device, bytes)) return true;
  if (fail_probability_ > 0.0) return std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < fail_probability_;
  return false;
}

std::uintptr_t SimBackend::take_address(Device& d, std::size_t bytes) {
  for (auto it = d.holes.begin(); it != d.holes.end(); ++it) {
    if (it->second < bytes) continue;
    const std::uintptr_t addr = it->first;
    const std::size_t rest = it->second - bytes;
    d.holes.erase(it);
    if (rest > 0) d.holes.emplace(addr + bytes, rest);
    return addr;
  }
  const std::uintptr_t addr = d.next;
  d.next += bytes;
  return addr;
}

void SimBackend::return_address(Device& d, std::uintptr_t addr, std::size_t bytes) {
  auto next = d.holes.lower_bound(addr);
  if (next != d.holes.end() && addr + bytes == next->first) {
    bytes += next->second;
    next = d.holes.erase(next);
  }
  if (next != d.holes.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == addr) {
      prev->second += bytes;
      return;
    }
  }
  d.holes.emplace(addr, bytes);
}

void* SimBackend::reserve(int device, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  if (bytes > capacity_ - d.ledger.in_use || should_fail(device, bytes)) {
    ++d.ledger.refusals;
    return nullptr;
  }
  const std::uintptr_t addr = take_address(d, bytes);
  d.live.emplace(addr, bytes);
  d.ledger.in_use += bytes;
  if (d.ledger.in_use > d.ledger.peak) d.ledger.peak = d.ledger.in_use;
  ++d.ledger.reserves;
  return reinterpret_cast<void*>(addr);
}

void SimBackend::release(int device, void* ptr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = d.live.find(addr);
  if (it == d.live.end() || it->second != bytes) {
    throw std::logic_error("gpumem: simulated device " + std::to_string(device) + " was asked to release " +
                           std::to_string(bytes) + " bytes at an address it did not hand out with that size");
  }
  d.live.erase(it);
  return_address(d, addr, bytes);
  d.ledger.in_use -= bytes;
  ++d.ledger.releases;
}

MemInfo SimBackend::mem_info(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Device& d = device_locked(device);
  return MemInfo{capacity_ - d.ledger.in_use, capacity_};
}

EventId SimBackend::record_event(int device, StreamId) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  auto id = reinterpret_cast<EventId>(next_event_++);
  events_.emplace(id, Event{device, false, 0});
  ++d.ledger.live_events;
  return id;
}

bool SimBackend::event_done(int, EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  Event& e = events_.at(event);
  ++e.queries;
  if (auto_complete_after_ > 0 && e.queries >= auto_complete_after_) e.done = true;
  return e.done;
}

void SimBackend::destroy_event(int, EventId event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = events_.find(event);
  --devices_[it->second.device].ledger.live_events;
  events_.erase(it);
}

void SimBackend::synchronize(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++device_locked(device).ledger.syncs;
  for (auto& [id, e] : events_) {
    if (e.device == device) e.done = true;
  }
}

void SimBackend::fail_next(int count) {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_next_ = count;
}

void SimBackend::fail_randomly(double probability, std::uint32_t seed) {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_probability_ = probability;
  rng_.seed(seed);
}

void SimBackend::fail_when(std::function<bool(int, std::size_t)> predicate) {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_predicate_ = std::move(predicate);
}

void SimBackend::stop_failing() {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_next_ = 0;
  fail_probability_ = 0.0;
  fail_predicate_ = nullptr;
}

void SimBackend::complete_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [id, e] : events_) e.done = true;
}

void SimBackend::auto_complete_after(int queries) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto_complete_after_ = queries;
}

SimBackend::Ledger SimBackend::ledger(int device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return device_locked(device).ledger;
}

void SimBackend::reset_peak(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  d.ledger.peak = d.ledger.in_use;
}

}  // namespace gpumem
