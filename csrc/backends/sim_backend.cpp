#include "backends/sim_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "core/errors.h"

namespace gpumem {

namespace {
// The smallest region: 16 TiB, far more than any device's segments need at today's sizes.
constexpr std::uintptr_t kMinSpan = std::uintptr_t{1} << 44;
static_assert(sizeof(std::uintptr_t) >= 8, "the simulated address layout needs 64-bit addresses");

// Room for the address holes that freeing leaves and for growable segments, whose ranges are as
// large as the device, one per stream and size class: 16 of them fit in a region at least.
std::uintptr_t region_span(std::size_t capacity) {
  std::uintptr_t span = kMinSpan;
  while (span / 16 < capacity) span <<= 1;
  return span;
}

std::string hex(std::uintptr_t addr) {
  char buf[2 + 16 + 1];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(addr));
  return buf;
}

// What the simulated processes (SimBackends) exported, shared by all of them as a driver's handles
// are: plain segments by handle, chunks by descriptor number. Locked after a backend's own mutex.
struct SharedTable {
  struct Export {
    const void* owner = nullptr;  // the exporting SimBackend
    int device = 0;
    std::uintptr_t addr = 0;
    std::size_t bytes = 0;
  };
  std::mutex mutex;
  std::map<std::string, Export> segments;
  std::map<int, Export> fds;
  int next_fd = 1000;
  std::uint64_t next_segment = 1;

  // Forgets `owner`'s exports on `device` inside [addr, addr + bytes); how many went.
  std::size_t forget(const void* owner, int device, std::uintptr_t addr, std::size_t bytes) {
    std::size_t gone = 0;
    const auto inside = [&](const Export& e) { return e.owner == owner && e.device == device && e.addr >= addr && e.addr < addr + bytes; };
    for (auto it = segments.begin(); it != segments.end();) it = inside(it->second) ? (++gone, segments.erase(it)) : std::next(it);
    for (auto it = fds.begin(); it != fds.end();) it = inside(it->second) ? (++gone, fds.erase(it)) : std::next(it);
    return gone;
  }
};

SharedTable& shared_table() {
  static SharedTable* table = new SharedTable;  // never destroyed: backends may outlive statics
  return *table;
}

// Memory going back takes its exports with it; a backend that exported nothing (nearly every
// one) skips the shared table and its lock.
void forget_exports(const void* owner, SimBackend::Ledger& ledger, int device, std::uintptr_t addr, std::size_t bytes) {
  if (ledger.exports == 0) return;
  SharedTable& table = shared_table();
  std::lock_guard<std::mutex> shared(table.mutex);
  ledger.exports -= table.forget(owner, device, addr, bytes);
}

[[noreturn]] void misuse(const char* call, int device, std::uintptr_t addr, std::size_t bytes, const char* why) {
  throw std::logic_error(std::string("gpumem: simulated device ") + std::to_string(device) + ": " + call + "(" +
                         hex(addr) + ", " + std::to_string(bytes) + " bytes) " + why);
}
}  // namespace

SimBackend::~SimBackend() {
  SharedTable& table = shared_table();
  std::lock_guard<std::mutex> shared(table.mutex);
  for (int device = 0; device < device_count_; ++device) table.forget(this, device, 0, UINTPTR_MAX);
}

SimBackend::SimBackend(std::size_t capacity, int devices)
    : capacity_(capacity), span_(0), device_count_(devices) {
  if (capacity > kMaxCapacity) {
    throw std::invalid_argument("gpumem: a simulated device of " + std::to_string(capacity) + " bytes (" +
                                format_bytes(capacity) + ") is larger than the simulator models: at most " +
                                std::to_string(kMaxCapacity) + " bytes (" + format_bytes(kMaxCapacity) + ")");
  }
  if (devices < 1 || devices > kMaxDevices) {
    throw std::invalid_argument("gpumem: " + std::to_string(devices) + " simulated devices: expected 1 to " +
                                std::to_string(kMaxDevices));
  }
  span_ = region_span(capacity);
  if (2 * static_cast<std::uintptr_t>(devices) + 1 > UINTPTR_MAX / span_) {
    throw std::invalid_argument("gpumem: " + std::to_string(devices) + " simulated devices of " +
                                format_bytes(capacity) + " do not fit in a 64-bit address space; use fewer "
                                "devices or smaller ones");
  }
  devices_.resize(static_cast<std::size_t>(devices));
}

std::uintptr_t SimBackend::region_base(int device, bool ranges) const {
  const auto index = static_cast<std::uintptr_t>(device) + (ranges ? static_cast<std::uintptr_t>(device_count_) : 0);
  return span_ * (1 + index);
}

SimBackend::AddressSpace SimBackend::fresh_region(int device, bool ranges) const {
  const std::uintptr_t base = region_base(device, ranges);
  return AddressSpace{base, base + span_, {}};
}

SimBackend::Device& SimBackend::device_locked(int device) const {
  if (device < 0 || device >= device_count_) {
    throw DeviceError("gpumem: simulated device " + std::to_string(device) + " does not exist; devices are 0.." +
                      std::to_string(device_count_ - 1));
  }
  std::unique_ptr<Device>& slot = devices_[static_cast<std::size_t>(device)];
  if (!slot) {
    slot = std::make_unique<Device>();
    slot->segments = fresh_region(device, false);
    slot->addresses = fresh_region(device, true);
  }
  return *slot;
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
  if (bytes == 0 || bytes > end - next) return 0;
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
  if (bytes > free_of(d) || should_fail(device, bytes)) {
    ++d.ledger.refusals;
    return nullptr;
  }
  const std::uintptr_t addr = d.segments.take(bytes);
  if (addr == 0) {  // the region is used up
    ++d.ledger.refusals;
    return nullptr;
  }
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
  forget_exports(this, d.ledger, device, addr, bytes);
  d.segments.give_back(addr, bytes);
  d.ledger.in_use -= bytes;
  ++d.ledger.releases;
}

MemInfo SimBackend::mem_info(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Device& d = device_locked(device);
  return MemInfo{free_of(d), capacity_};
}

std::size_t SimBackend::free_of(const Device& d) const {
  return capacity_ - d.ledger.in_use - d.outside - d.others;
}

std::optional<std::size_t> SimBackend::process_used(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!process_accounting_ || device < 0 || device >= device_count_) return std::nullopt;  // never throws
  const Device& d = device_locked(device);
  return d.ledger.in_use + d.outside;
}

std::vector<ProcessUse> SimBackend::processes_on(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (device < 0 || device >= device_count_) return {};  // never throws
  return device_locked(device).processes;
}

void SimBackend::set_processes(int device, std::vector<ProcessUse> processes) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_locked(device).processes = std::move(processes);
}

void SimBackend::set_use_outside(int device, std::size_t process, std::size_t others) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  const std::size_t room = capacity_ - d.ledger.in_use;
  if (process > room || others > room - process) {
    throw std::invalid_argument("gpumem: simulated device " + std::to_string(device) + " cannot hold " +
                                std::to_string(process) + " bytes for the process and " + std::to_string(others) +
                                " for others outside the allocator: it has " + std::to_string(room) +
                                " bytes besides what it handed out");
  }
  d.outside = process;
  d.others = others;
}

void SimBackend::set_process_accounting(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  process_accounting_ = on;
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
  if (page < 512 || (page & (page - 1)) != 0 || page > span_) {
    throw std::invalid_argument("gpumem: simulated page size " + std::to_string(page) +
                                " is not a power of two from 512 bytes to " + std::to_string(span_));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (page == page_) return;
  for (const std::unique_ptr<Device>& d : devices_) {
    if (d && !d->ranges.empty()) {
      throw std::logic_error("gpumem: the simulated page size cannot change while address ranges are reserved");
    }
  }
  // Holes and the bump pointer are aligned to the old page only; start each region afresh.
  for (std::size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i]) devices_[i]->addresses = fresh_region(static_cast<int>(i), true);
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
  if (addr == 0) return nullptr;  // the region is used up
  d.ranges.emplace(addr, Range{bytes, {}, {}});
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
  if (!it->second.mapped.empty()) {
    misuse("release_address", device, addr, bytes, "still has pages mapped; unmap them first");
  }
  d.addresses.give_back(addr, bytes);
  d.ranges.erase(it);
  --d.ledger.address_ranges;
}

std::size_t SimBackend::PageSpan::mapped() const {
  const std::size_t end = first + count;
  auto it = range->mapped.upper_bound(first);
  if (it != range->mapped.begin()) --it;
  std::size_t pages = 0;
  for (; it != range->mapped.end() && it->first < end; ++it) {
    const std::size_t lo = std::max(it->first, first), hi = std::min(it->second, end);
    if (hi > lo) pages += hi - lo;
  }
  return pages;
}

// Whether the span (all mapped) is made of whole mappings: one starts at its first page and each
// ends where the next starts, the last at its end.
bool SimBackend::PageSpan::whole_mappings() const {
  std::size_t at = first;
  for (auto it = range->mappings.find(first); it != range->mappings.end() && it->first == at; ++it) {
    at = it->second;
    if (at >= first + count) return at == first + count;
  }
  return false;
}

// Takes out every run that overlaps or touches the span, then puts back what lies outside it
// (unmapping) or one run covering them all (mapping), so runs stay disjoint and never adjacent.
void SimBackend::PageSpan::mark(bool mapped) const {
  std::map<std::size_t, std::size_t>& runs = range->mapped;
  std::size_t lo = first, hi = first + count;
  auto it = runs.upper_bound(lo);
  if (it != runs.begin() && std::prev(it)->second >= lo) --it;
  std::vector<std::pair<std::size_t, std::size_t>> outside;
  while (it != runs.end() && it->first <= hi) {
    const auto [a, b] = *it;
    it = runs.erase(it);
    if (mapped) {
      lo = std::min(lo, a);
      hi = std::max(hi, b);
    } else {
      if (a < lo) outside.emplace_back(a, lo);
      if (b > hi) outside.emplace_back(hi, b);
    }
  }
  if (mapped) runs.emplace(lo, hi);
  for (const auto& run : outside) runs.insert(run);
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

bool SimBackend::map(int device, void* ptr, std::size_t bytes, std::size_t chunk) {
  std::lock_guard<std::mutex> lock(mutex_);
  const PageSpan span = pages_of(device, ptr, bytes, "map");
  if (chunk == 0 || chunk % page_ != 0) misuse("map", device, reinterpret_cast<std::uintptr_t>(ptr), bytes, "names a chunk that is not whole pages");
  if (span.mapped() > 0) misuse("map", device, reinterpret_cast<std::uintptr_t>(ptr), bytes, "covers mapped pages");
  Device& d = device_locked(device);
  if (bytes > free_of(d) || should_fail(device, bytes)) {
    ++d.ledger.refusals;
    return false;
  }
  span.mark(true);
  for (std::size_t first = span.first, end = span.first + span.count; first < end; first += chunk / page_) {
    span.range->mappings.emplace(first, std::min(first + chunk / page_, end));
    ++d.ledger.allocations;
  }
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
  if (!span.whole_mappings()) {
    misuse("unmap", device, reinterpret_cast<std::uintptr_t>(ptr), bytes, "covers part of one map call's pages");
  }
  span.range->mappings.erase(span.range->mappings.lower_bound(span.first), span.range->mappings.lower_bound(span.first + span.count));
  span.mark(false);
  Device& d = device_locked(device);
  const auto at = reinterpret_cast<std::uintptr_t>(ptr);
  d.contents.erase(d.contents.lower_bound(at), d.contents.lower_bound(at + bytes));  // the memory is gone
  forget_exports(this, d.ledger, device, reinterpret_cast<std::uintptr_t>(ptr), bytes);
  d.ledger.in_use -= bytes;
  d.ledger.mapped -= bytes;
  ++d.ledger.unmaps;
}

namespace {

// A backup's host memory, simulated: the device range it was allocated for and the values copied
// into it, by device address.
struct SimCopy {
  std::uintptr_t lo = 0;
  std::size_t bytes = 0;
  std::map<std::uintptr_t, std::uint64_t> values;
};

// Whether `c` lies at its offset in the host memory it names, as the core must place it.
bool placed(const HostCopy& c) {
  const auto* host = static_cast<const SimCopy*>(c.host);
  return c.device_addr == host->lo + c.offset && c.offset + c.bytes <= host->bytes;
}

void allocate(HostCopy& c, std::size_t& held) {
  c.host = new SimCopy{c.device_addr, c.bytes, {}};
  c.offset = 0;
  held += c.bytes;
}

}  // namespace

void SimBackend::back_up(int device, std::vector<HostCopy>& copies) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  for (const HostCopy& c : copies) {
    for (std::uintptr_t a = c.device_addr; a < c.device_addr + c.bytes; a += page_) {
      if (!is_mapped_locked(d, a)) misuse("back_up", device, c.device_addr, c.bytes, "covers pages that are not mapped");
    }
    if (c.host && !placed(c)) misuse("back_up", device, c.device_addr, c.bytes, "lies outside the host memory it names");
  }
  for (HostCopy& c : copies) {
    if (!c.host) allocate(c, d.ledger.host_held);
    auto& values = static_cast<SimCopy*>(c.host)->values;
    values.erase(values.lower_bound(c.device_addr), values.lower_bound(c.device_addr + c.bytes));
    values.insert(d.contents.lower_bound(c.device_addr), d.contents.lower_bound(c.device_addr + c.bytes));
    d.ledger.backed_up += c.bytes;
  }
}

void SimBackend::allocate_backup(int device, std::vector<HostCopy>& copies) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  for (HostCopy& c : copies) {
    if (!c.host) allocate(c, d.ledger.host_held);
  }
}

void SimBackend::restore(int device, const std::vector<HostCopy>& copies) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  for (const HostCopy& c : copies) {
    if (!c.host) misuse("restore", device, c.device_addr, c.bytes, "names no backup");
    if (!placed(c)) misuse("restore", device, c.device_addr, c.bytes, "lies outside the host memory it names");
    for (std::uintptr_t a = c.device_addr; a < c.device_addr + c.bytes; a += page_) {
      if (!is_mapped_locked(d, a)) misuse("restore", device, c.device_addr, c.bytes, "covers pages that are not mapped");
    }
  }
  for (const HostCopy& c : copies) {
    const auto& values = static_cast<const SimCopy*>(c.host)->values;
    for (auto it = values.lower_bound(c.device_addr); it != values.lower_bound(c.device_addr + c.bytes); ++it) {
      d.contents[it->first] = it->second;
    }
    d.ledger.restored += c.bytes;
  }
}

void SimBackend::drop_backup(int device, std::vector<HostCopy>& copies) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  for (HostCopy& c : copies) {
    if (!c.host) continue;
    delete static_cast<SimCopy*>(c.host);
    c.host = nullptr;
    d.ledger.host_held -= c.bytes;
  }
}

void SimBackend::write(int device, std::uintptr_t addr, std::uint64_t value) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  if (!is_mapped_locked(d, addr)) misuse("write", device, addr, sizeof value, "is not mapped");
  d.contents[addr] = value;
}

std::optional<std::uint64_t> SimBackend::read(int device, std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Device& d = device_locked(device);
  if (!is_mapped_locked(d, addr)) misuse("read", device, addr, sizeof(std::uint64_t), "is not mapped");
  const auto it = d.contents.find(addr);
  if (it == d.contents.end()) return std::nullopt;
  return it->second;
}

void SimBackend::grant_peer(int device, int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  device_locked(peer);
  device_locked(device).peers.insert(peer);
}

bool SimBackend::is_mapped_locked(const Device& d, std::uintptr_t addr) const {
  auto it = d.ranges.upper_bound(addr);
  if (it == d.ranges.begin()) return false;
  --it;
  const std::uintptr_t offset = addr - it->first;
  if (offset >= it->second.bytes) return false;
  const std::size_t page = offset / page_;
  const auto& runs = it->second.mapped;
  auto run = runs.upper_bound(page);
  return run != runs.begin() && std::prev(run)->second > page;
}

bool SimBackend::is_mapped(int device, std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return is_mapped_locked(device_locked(device), addr);
}

bool SimBackend::holds_whole_chunk(int device, std::uintptr_t addr, std::size_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Device& d = device_locked(device);
  auto it = d.ranges.upper_bound(addr);
  if (it == d.ranges.begin()) return false;
  --it;
  if (addr - it->first >= it->second.bytes) return false;
  const std::size_t first = (addr - it->first + page_ - 1) / page_;
  const std::size_t end = (std::min(addr + bytes - it->first, it->second.bytes)) / page_;
  const auto chunk = it->second.mappings.lower_bound(first);
  return chunk != it->second.mappings.end() && chunk->second <= end;
}

bool SimBackend::peer_can_access(int device, int peer, std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Device& d = device_locked(device);
  device_locked(peer);
  return is_mapped_locked(d, addr) && (peer == device || d.peers.count(peer) > 0);
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
  --device_locked(it->second.device).ledger.live_events;
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

// ---- Sharing with other processes -------------------------------------------------------------

std::string SimBackend::export_segment(int device, void* base) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  const auto live = d.live.find(addr);
  if (live == d.live.end()) misuse("export_segment", device, addr, 0, "is not the start of a segment reserve handed out");
  SharedTable& table = shared_table();
  std::lock_guard<std::mutex> shared(table.mutex);
  for (const auto& [handle, e] : table.segments) {
    if (e.owner == this && e.device == device && e.addr == addr) return handle;
  }
  std::string handle = "gpumem-sim-segment-" + std::to_string(table.next_segment++);
  handle.resize(64, '\0');
  table.segments[handle] = {this, device, addr, live->second};
  ++d.ledger.exports;
  return handle;
}

void* SimBackend::open_segment(int device, const std::string& handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  std::size_t bytes = 0;
  {
    SharedTable& table = shared_table();
    std::lock_guard<std::mutex> shared(table.mutex);
    const auto found = table.segments.find(handle);
    if (found == table.segments.end()) throw std::runtime_error("gpumem: cudaIpcOpenMemHandle failed: invalid resource handle (simulated)");
    if (found->second.owner == this) {
      throw std::runtime_error("gpumem: cudaIpcOpenMemHandle failed: the handle was made by this process (simulated)");
    }
    bytes = found->second.bytes;
  }
  const std::uintptr_t addr = d.addresses.take(bytes);
  if (addr == 0) throw std::runtime_error("gpumem: cudaIpcOpenMemHandle failed: out of address space (simulated)");
  d.imported.emplace(addr, bytes);
  d.ledger.imported += bytes;
  return reinterpret_cast<void*>(addr);
}

void SimBackend::close_segment(int device, void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  const auto found = d.imported.find(addr);
  if (found == d.imported.end()) misuse("close_segment", device, addr, 0, "is not memory opened from another process");
  d.addresses.give_back(addr, found->second);
  d.ledger.imported -= found->second;
  d.imported.erase(found);
}

std::vector<int> SimBackend::export_chunks(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& chunks) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  SharedTable& table = shared_table();
  std::lock_guard<std::mutex> shared(table.mutex);
  std::vector<int> fds;
  for (const auto& [addr, bytes] : chunks) {
    const PageSpan span = pages_of(device, reinterpret_cast<void*>(addr), bytes, "export_chunks");
    const auto mapping = span.range->mappings.find(span.first);
    if (mapping == span.range->mappings.end() || mapping->second != span.first + span.count) {
      misuse("export_chunks", device, addr, bytes, "is not one map call's chunk");
    }
    int fd = -1;
    for (const auto& [number, e] : table.fds) {
      if (e.owner == this && e.device == device && e.addr == addr) fd = number;
    }
    if (fd < 0) {
      fd = table.next_fd++;
      table.fds[fd] = {this, device, addr, bytes};
      ++d.ledger.exports;
    }
    fds.push_back(fd);
  }
  return fds;
}

void* SimBackend::open_chunks(int device, int pid, const std::vector<int>& fds, const std::vector<std::size_t>& bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  if (fds.empty() || fds.size() != bytes.size()) throw std::invalid_argument("gpumem: open_chunks needs one size per descriptor");
  const auto fail = [pid](const char* why) {
    return std::runtime_error("gpumem: cannot take growable memory from process " + std::to_string(pid) + ": pidfd_getfd failed: " +
                              why + " (simulated)");
  };
  if (pid != static_cast<int>(getpid())) throw fail("No such process");
  if (refuse_imports_) throw fail("Operation not permitted");
  std::size_t total = 0;
  {
    SharedTable& table = shared_table();
    std::lock_guard<std::mutex> shared(table.mutex);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      const auto found = table.fds.find(fds[i]);
      if (found == table.fds.end()) throw fail("Bad file descriptor");
      if (found->second.owner == this) throw fail("the descriptor is this process's own");
      if (found->second.bytes != bytes[i]) {
        throw std::runtime_error("gpumem: cuMemMap failed: a chunk of " + std::to_string(found->second.bytes) + " bytes mapped as " +
                                 std::to_string(bytes[i]) + " (simulated)");
      }
      total += bytes[i];
    }
  }
  const std::uintptr_t addr = d.addresses.take(total);
  if (addr == 0) throw std::runtime_error("gpumem: cuMemAddressReserve failed: out of address space (simulated)");
  d.imported.emplace(addr, total);
  d.ledger.imported += total;
  return reinterpret_cast<void*>(addr);
}

void SimBackend::close_chunks(int device, void* ptr, const std::vector<std::size_t>& bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& d = device_locked(device);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::size_t total = 0;
  for (const std::size_t b : bytes) total += b;
  const auto found = d.imported.find(addr);
  if (found == d.imported.end() || found->second != total) {
    misuse("close_chunks", device, addr, total, "is not memory open_chunks opened with these sizes");
  }
  d.addresses.give_back(addr, total);
  d.ledger.imported -= total;
  d.imported.erase(found);
}

void SimBackend::refuse_imports(bool refuse) {
  std::lock_guard<std::mutex> lock(mutex_);
  refuse_imports_ = refuse;
}

}  // namespace gpumem
