#include "backends/sim_backend.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "core/errors.h"

namespace gpumem {

namespace {
// Each device's fake addresses start at its own terabyte-aligned base, far from real memory.
constexpr std::uintptr_t kDeviceSpan = std::uintptr_t{1} << 44;
// Reserved address ranges come from a region of their own, above the plain segments of up to 4095
// devices, so a test can tell the two apart and a range can never alias a segment.
constexpr std::uintptr_t kVirtualBase = std::uintptr_t{1} << 56;
static_assert(sizeof(std::uintptr_t) >= 8, "the simulated address layout needs 64-bit addresses");

std::uintptr_t virtual_base(int device) { return kVirtualBase + kDeviceSpan * static_cast<std::uintptr_t>(device); }

std::string hex(std::uintptr_t addr) {
  char buf[2 + 16 + 1];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(addr));
  return buf;
}

[[noreturn]] void misuse(const char* call, int device, std::uintptr_t addr, std::size_t bytes, const char* why) {
  throw std::logic_error(std::string("gpumem: simulated device ") + std::to_string(device) + ": " + call + "(" +
                         hex(addr) + ", " + std::to_string(bytes) + " bytes) " + why);
}
}  // namespace

SimBackend::SimBackend(std::size_t capacity, int devices) : capacity_(capacity), devices_(devices) {
  for (int i = 0; i < devices; ++i) {
    devices_[i].segments.next = kDeviceSpan * static_cast<std::uintptr_t>(i + 1);
    devices_[i].addresses.next = virtual_base(i);
    devices_[i].peers.assign(devices, false);
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

std::uintptr_t SimBackend::AddressSpace::take(std::size_t bytes) {
  for (auto it = holes.begin(); it != holes.end(); ++it) {
    if (it->second < bytes) continue;
    const std::uintptr_t addr = it->first;
    const std::size_t rest = it->second - bytes;
    holes.erase(it);
    if (rest > 0) holes.emplace(addr + bytes, rest);
    return addr;
  }
  const std::uintptr_t addr = next;
  next += bytes;
  return addr;
}

void SimBackend::AddressSpace::give_back(std::uintptr_t addr, std::size_t bytes) {
  auto after = holes.lower_bound(addr);
  if (after != holes.end() && addr + bytes == after->first) {
    bytes += after->second;
    after = holes.erase(after);
  }
  if (after != holes.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == addr) {
      prev->second += bytes;
      return;
    }
  }
  holes.emplace(addr, bytes);
}

void SimBackend::add_in_use(Device& d, std::size_t bytes) {
  d.ledger.in_use += bytes;
  if (d.ledger.in_use > d.ledger.peak) d.ledger.peak = d.ledger.in_use;
}

void* SimBackend::reserve(int device, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  if (bytes > capacity_ - d.ledger.in_use || should_fail(device, bytes)) {
    ++d.ledger.refusals;
    return nullptr;
  }
  const std::uintptr_t addr = d.segments.take(bytes);
  d.live.emplace(addr, bytes);
  add_in_use(d, bytes);
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
  d.segments.give_back(addr, bytes);
  d.ledger.in_use -= bytes;
  ++d.ledger.releases;
}

MemInfo SimBackend::mem_info(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Device& d = device_locked(device);
  return MemInfo{capacity_ - d.ledger.in_use, capacity_};
}

std::size_t SimBackend::total_memory(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_locked(device);  // throws for a device that is not there
  return capacity_;
}

// ---- Virtual memory ---------------------------------------------------------------------------

std::size_t SimBackend::page_size(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_locked(device);
  return page_;
}

void SimBackend::enable_virtual_memory(std::size_t page) {
  if (page < 512 || (page & (page - 1)) != 0) {
    throw std::invalid_argument("gpumem: simulated page size " + std::to_string(page) +
                                " is not a power of two of at least 512 bytes");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (page == page_) return;
  for (const Device& d : devices_) {
    if (!d.ranges.empty()) {
      throw std::logic_error("gpumem: the simulated page size cannot change while address ranges are reserved");
    }
  }
  // Holes and the bump pointer are aligned to the old page only; start each region afresh.
  for (std::size_t i = 0; i < devices_.size(); ++i) {
    devices_[i].addresses = AddressSpace{virtual_base(static_cast<int>(i)), {}};
  }
  page_ = page;
}

void SimBackend::refuse_addresses(bool refuse) {
  std::lock_guard<std::mutex> lock(mutex_);
  refuse_addresses_ = refuse;
}

void* SimBackend::reserve_address(int device, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  // Without virtual memory the backend answers as core/backend.h's default does.
  if (page_ == 0 || refuse_addresses_) return nullptr;
  if (bytes == 0 || bytes % page_ != 0) {
    throw std::logic_error("gpumem: simulated device " + std::to_string(device) + ": reserve_address of " +
                           std::to_string(bytes) + " bytes, not a positive multiple of the " +
                           std::to_string(page_) + "-byte page");
  }
  // Every range and hole is a multiple of the page from a page-aligned base, so addresses stay aligned.
  const std::uintptr_t addr = d.addresses.take(bytes);
  d.ranges.emplace(addr, Range{bytes, std::vector<bool>(bytes / page_, false)});
  ++d.ledger.address_ranges;
  return reinterpret_cast<void*>(addr);
}

void SimBackend::release_address(int device, void* ptr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = d.ranges.find(addr);
  if (it == d.ranges.end() || it->second.bytes != bytes) {
    misuse("release_address", device, addr, bytes, "is not a range reserve_address handed out");
  }
  if (PageSpan{&it->second, 0, it->second.pages.size()}.mapped() > 0) {
    misuse("release_address", device, addr, bytes, "still has pages mapped; unmap them first");
  }
  d.addresses.give_back(addr, bytes);
  d.ranges.erase(it);
  --d.ledger.address_ranges;
}

std::size_t SimBackend::PageSpan::mapped() const {
  const auto begin = range->pages.begin() + static_cast<std::ptrdiff_t>(first);
  return static_cast<std::size_t>(std::count(begin, begin + static_cast<std::ptrdiff_t>(count), true));
}

void SimBackend::PageSpan::mark(bool mapped) const {
  const auto begin = range->pages.begin() + static_cast<std::ptrdiff_t>(first);
  std::fill(begin, begin + static_cast<std::ptrdiff_t>(count), mapped);
}

// The pages a map or unmap call names; throws when they are unaligned or not inside one range,
// since either means the allocator lost track of its ranges.
SimBackend::PageSpan SimBackend::pages_of(int device, void* ptr, std::size_t bytes, const char* call) {
  Device& d = device_locked(device);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  if (page_ == 0) misuse(call, device, addr, bytes, "was called, but virtual memory is not enabled");
  if (bytes == 0 || bytes % page_ != 0 || addr % page_ != 0) misuse(call, device, addr, bytes, "is not page-aligned");
  auto it = d.ranges.upper_bound(addr);
  if (it == d.ranges.begin()) misuse(call, device, addr, bytes, "is not inside a reserved range");
  --it;
  const std::uintptr_t offset = addr - it->first;
  if (offset >= it->second.bytes || bytes > it->second.bytes - offset) {
    misuse(call, device, addr, bytes, "is not inside a reserved range");
  }
  return PageSpan{&it->second, offset / page_, bytes / page_};
}

bool SimBackend::map(int device, void* ptr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const PageSpan span = pages_of(device, ptr, bytes, "map");
  if (span.mapped() > 0) misuse("map", device, reinterpret_cast<std::uintptr_t>(ptr), bytes, "covers mapped pages");
  Device& d = devices_[device];
  if (bytes > capacity_ - d.ledger.in_use || should_fail(device, bytes)) {
    ++d.ledger.refusals;
    return false;
  }
  span.mark(true);
  add_in_use(d, bytes);
  d.ledger.mapped += bytes;
  ++d.ledger.maps;
  return true;
}

void SimBackend::unmap(int device, void* ptr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const PageSpan span = pages_of(device, ptr, bytes, "unmap");
  if (span.mapped() != span.count) {
    misuse("unmap", device, reinterpret_cast<std::uintptr_t>(ptr), bytes, "covers pages that are not mapped");
  }
  span.mark(false);
  Device& d = devices_[device];
  d.ledger.in_use -= bytes;
  d.ledger.mapped -= bytes;
  ++d.ledger.unmaps;
}

void SimBackend::grant_peer(int device, int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_locked(peer);
  device_locked(device).peers[peer] = true;
}

bool SimBackend::is_mapped_locked(const Device& d, std::uintptr_t addr) const {
  auto it = d.ranges.upper_bound(addr);
  if (it == d.ranges.begin()) return false;
  --it;
  const std::uintptr_t offset = addr - it->first;
  return offset < it->second.bytes && it->second.pages[offset / page_];
}

bool SimBackend::is_mapped(int device, std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return is_mapped_locked(device_locked(device), addr);
}

bool SimBackend::peer_can_access(int device, int peer, std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Device& d = device_locked(device);
  device_locked(peer);
  return is_mapped_locked(d, addr) && (peer == device || d.peers[peer]);
}

// ---- Events ----------------------------------------------------------------------------------

EventId SimBackend::record_event(int device, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  auto id = reinterpret_cast<EventId>(next_event_++);
  events_.emplace(id, Event{device, stream, false, 0});
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

void SimBackend::synchronize_stream(int device, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++device_locked(device).ledger.stream_syncs;
  for (auto& [id, e] : events_) {
    if (e.device == device && e.stream == stream) e.done = true;
  }
}

// ---- Stream capture ---------------------------------------------------------------------------

CaptureMarker SimBackend::capture_marker(int device, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (refuse_markers_) return 0;
  StreamClocks& s = device_locked(device).streams;
  const CaptureMarker marker = next_marker_++;
  s.markers[marker] = {stream, ++s.marks[stream]};
  return marker;
}

bool SimBackend::capture_follows(int device, StreamId stream, CaptureMarker marker) {
  std::lock_guard<std::mutex> lock(mutex_);
  StreamClocks& s = device_locked(device).streams;
  const auto [marked, mark] = s.markers.at(marker);
  return marked == stream || s.clock[stream][marked] >= mark;
}

void SimBackend::wait_stream(int device, StreamId waiter, StreamId waited) {
  std::lock_guard<std::mutex> lock(mutex_);
  StreamClocks& s = device_locked(device).streams;
  auto& mine = s.clock[waiter];
  mine[waited] = std::max(mine[waited], s.marks[waited]);
  for (const auto& [other, mark] : s.clock[waited]) mine[other] = std::max(mine[other], mark);
}

void SimBackend::refuse_capture_markers(bool refuse) {
  std::lock_guard<std::mutex> lock(mutex_);
  refuse_markers_ = refuse;
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
