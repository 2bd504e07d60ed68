// A simulated device: hands out non-overlapping fake addresses from a fixed capacity, never touches
// memory (a trace that peaked at 80 GB replays on a laptop), and can be told to refuse requests
// (fault injection). It also keeps its own account of what it handed out, which tests use to check
// the allocator's cap independently of the allocator's statistics.
//
// Virtual memory (off until enable_virtual_memory): reserve_address hands out page-aligned ranges
// from a region of fake addresses of its own, far above the plain segments', and costs no memory;
// map backs pages of a range and counts them as memory in use, in the same ledger as plain
// segments, so the capacity, the peak and mem_info cover both. The backend enforces the contract of
// core/backend.h and throws std::logic_error where the allocator breaks it (mapping a page twice,
// unmapping one that is not mapped or part of one map call's pages, releasing a range with pages
// mapped, unaligned arguments).
//
// Address layout: each device has two regions of `span` bytes (a power of two, at least 16 times
// its capacity and at least 16 TiB), one for plain segments and one for reserved ranges, laid out
// one after the other from `span` up; an address names its device and kind, and no two live
// allocations of any device ever overlap. A region that is used up refuses further requests, as a
// driver out of address space would; nothing wraps around. Devices are made on first use and pages
// are kept as runs, so a large device or many of them cost memory only for what is used.
//
// Invariants, per device:
//   ledger.in_use == sum of live plain segments + ledger.mapped <= capacity
//   ledger.mapped == page size * pages in the mapped runs of all ranges
//   ledger.address_ranges == ranges.size(); live ranges never overlap each other or a segment
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <unordered_map>
#include <vector>

#include "core/backend.h"

namespace gpumem {

class SimBackend : public Backend {
 public:
  // The largest device and the most devices the simulated address space lays out (see above).
  static constexpr std::size_t kMaxCapacity = std::size_t{1} << 50;  // 1 PiB
  static constexpr int kMaxDevices = 1 << 16;

  // `capacity` bytes on each of `devices` devices; std::invalid_argument (naming the numbers)
  // unless capacity <= kMaxCapacity, 1 <= devices <= kMaxDevices, and their regions fit in 64 bits.
  explicit SimBackend(std::size_t capacity, int devices = 1);
  ~SimBackend() override;
  SimBackend(const SimBackend&) = delete;
  SimBackend& operator=(const SimBackend&) = delete;

  int device_count() const override { return device_count_; }
  void* reserve(int device, std::size_t bytes) override;
  void release(int device, void* ptr, std::size_t bytes) override;
  MemInfo mem_info(int device) override;
  std::size_t total_memory(int device) override;
  // What the process holds on the device: the ledger's in_use plus the bytes set_use_outside
  // gives it; nullopt while process accounting is off.
  std::optional<std::size_t> process_used(int device) override;
  // What set_processes gave, as a driver's list of the processes on `device`.
  std::vector<ProcessUse> processes_on(int device) override;
  void set_processes(int device, std::vector<ProcessUse> processes);
  EventId record_event(int device, StreamId stream) override;
  bool event_done(int device, EventId event) override;
  void destroy_event(int device, EventId event) override;
  void synchronize(int device) override;
  // Completes the events recorded on `stream` (a stream's events are all the sim knows of its work).
  void synchronize_stream(int device, StreamId stream) override;

  // Virtual memory, as core/backend.h specifies it. page_size is 0 until enable_virtual_memory.
  std::size_t page_size(int device) override;
  void* reserve_address(int device, std::size_t bytes) override;
  void release_address(int device, void* ptr, std::size_t bytes) override;
  bool map(int device, void* ptr, std::size_t bytes, std::size_t chunk) override;
  void unmap(int device, void* ptr, std::size_t bytes) override;
  void grant_peer(int device, int peer) override;
  // Backups of a paused region: each copy holds the values written (write()) in its range; every
  // page of a range must be mapped (else a logic_error), and restore writes them back.
  void back_up(int device, std::vector<HostCopy>& copies) override;
  void allocate_backup(int device, std::vector<HostCopy>& copies) override;
  void restore(int device, const std::vector<HostCopy>& copies) override;
  void drop_backup(int device, std::vector<HostCopy>& copies) noexcept override;
  // Device memory's contents, simulated: a value at an address of a mapped page, lost when the
  // page is unmapped. read() of an address with no value written since is nullopt.
  void write(int device, std::uintptr_t addr, std::uint64_t value);
  std::optional<std::uint64_t> read(int device, std::uintptr_t addr) const;

  // Stream capture as the core sees it: a marker stands for the work a stream queued so far, and a
  // stream follows it once it has waited for that stream since (wait_stream, as cudaStreamWaitEvent
  // joins streams in a capture), directly or through other streams. A stream follows its own work.
  CaptureMarker capture_marker(int device, StreamId stream) override;
  bool capture_follows(int device, StreamId stream, CaptureMarker marker) override;
  // Sharing with other processes, simulated within one process: each SimBackend stands for a
  // process of its own, and what one exports another opens (opening one's own export fails, as
  // CUDA's does). Handles and descriptors live in a table all SimBackends share; an export goes
  // when its memory does (release, unmap). Memory opened from another counts in `imported`, never
  // in in_use: it is the exporter's. The contract is core/backend.h's; breaches are logic_errors.
  std::string export_segment(int device, void* base) override;
  void* open_segment(int device, const std::string& handle) override;
  void close_segment(int device, void* ptr) override;
  std::vector<int> export_chunks(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& chunks) override;
  void* open_chunks(int device, int pid, const std::vector<int>& fds, const std::vector<std::size_t>& bytes) override;
  void close_chunks(int device, void* ptr, const std::vector<std::size_t>& bytes) override;
  // While set, open_chunks fails as pidfd_getfd does for a sender of another user (EPERM).
  void refuse_imports(bool refuse);

  // `waiter`'s later work runs after everything `waited` queued so far.
  void wait_stream(int device, StreamId waiter, StreamId waited);
  // Turns markers off (capture_marker returns 0), as a backend that cannot read the graph.
  void refuse_capture_markers(bool refuse);

  // Turns virtual memory on for every device with mapping granularity `page` (a power of two of at
  // least 512 bytes, else std::invalid_argument). An allocator reads the page size when it is
  // built, so call this first. Changing the page while address ranges are live is a logic_error.
  void enable_virtual_memory(std::size_t page);
  // While set, reserve_address returns nullptr, as a driver out of address space would.
  void refuse_addresses(bool refuse);
  // Whether the page holding `addr` is mapped on `device`.
  bool is_mapped(int device, std::uintptr_t addr) const;
  // Whether some map call's chunk (one physical allocation, given back whole) lies wholly inside
  // [addr, addr + bytes) on `device`: memory there that an unmap could give back.
  bool holds_whole_chunk(int device, std::uintptr_t addr, std::size_t bytes) const;
  // Whether `peer` may access `addr` on `device`: its page is mapped and `peer` was granted (a
  // device always reaches its own pages).
  bool peer_can_access(int device, int peer, std::uintptr_t addr) const;

  // Memory on `device` that is not the allocator's, as a driver would count it: `process` bytes of
  // this process (a library's buffers) and `others` of other processes. Both are used memory in
  // mem_info and leave that much less for requests; std::invalid_argument (naming the numbers) if
  // they do not fit beside what is handed out.
  void set_use_outside(int device, std::size_t process, std::size_t others = 0);
  // Whether process_used answers (on by default), as a driver that lists this process.
  void set_process_accounting(bool on);

  // Fault injection. A request (a reserve or a map call) is refused when any of these says so.
  void fail_next(int count);                      // refuse the next `count` requests
  void fail_randomly(double probability, std::uint32_t seed);
  void fail_when(std::function<bool(int device, std::size_t bytes)> predicate);
  void stop_failing();

  // Events complete when the device is synchronized, when complete_events() is called, or (with
  // auto_complete_after(n)) on their n-th query. By default they never complete on their own.
  void complete_events();
  void auto_complete_after(int queries);

  // The backend's own ledger.
  struct Ledger {
    std::size_t in_use = 0;      // bytes handed out now: plain segments plus mapped pages
    std::size_t peak = 0;        // most bytes handed out at once
    std::uint64_t reserves = 0;  // successful reserve calls
    std::uint64_t releases = 0;
    std::uint64_t refusals = 0;  // reserve and map calls refused
    std::uint64_t syncs = 0;         // synchronize calls (the whole device)
    std::uint64_t stream_syncs = 0;  // synchronize_stream calls
    std::size_t live_events = 0;
    std::size_t mapped = 0;          // bytes mapped now (part of in_use)
    std::uint64_t maps = 0;          // successful map calls
    std::uint64_t allocations = 0;   // physical allocations those made (one per chunk), ever
    std::uint64_t unmaps = 0;
    std::size_t address_ranges = 0;  // live reserved address ranges
    std::size_t exports = 0;         // segments and chunks exported now (handles other processes may open)
    std::size_t imported = 0;        // bytes opened from other processes now (not in in_use)
    std::size_t backed_up = 0;       // bytes back_up copied to the host, ever
    std::size_t restored = 0;        // bytes restore copied back, ever
    std::size_t host_held = 0;       // bytes of backups held now
  };
  Ledger ledger(int device) const;
  void reset_peak(int device);

 private:
  struct Event {
    int device = 0;
    StreamId stream = 0;
    bool done = false;
    int queries = 0;
  };
  // Fake addresses of one region, handed out first-fit from released holes, then from a bump
  // pointer that stops at the region's end: take returns 0 when nothing is left.
  struct AddressSpace {
    std::uintptr_t next = 0;                      // bump pointer
    std::uintptr_t end = 0;                       // the region's end
    std::map<std::uintptr_t, std::size_t> holes;  // released address ranges, by address
    std::uintptr_t take(std::size_t bytes);
    void give_back(std::uintptr_t addr, std::size_t bytes);
  };
  // A reserved address range; `mapped` holds its mapped pages as runs, first page -> end page
  // (exclusive), disjoint and never adjacent; `mappings` each map call's pages, first page -> end
  // page, since an unmap gives back whole mappings only, as a driver does.
  struct Range {
    std::size_t bytes = 0;
    std::map<std::size_t, std::size_t> mapped;
    std::map<std::size_t, std::size_t> mappings;
  };
  // Which work each stream follows: clock[s][t] is the newest mark of t that s's work follows.
  struct StreamClocks {
    std::map<StreamId, std::uint64_t> marks;                           // marks made on each stream
    std::map<StreamId, std::map<StreamId, std::uint64_t>> clock;
    std::map<CaptureMarker, std::pair<StreamId, std::uint64_t>> markers;  // marker -> (stream, mark)
  };
  struct Device {
    StreamClocks streams;
    AddressSpace segments;                                 // plain segments' addresses
    std::unordered_map<std::uintptr_t, std::size_t> live;  // address -> size
    AddressSpace addresses;                                // reserved ranges' addresses
    std::map<std::uintptr_t, Range> ranges;                // by start address
    std::set<int> peers;                                   // granted by grant_peer
    Ledger ledger;
    std::size_t outside = 0;  // set_use_outside's: in_use + outside + others <= capacity
    std::size_t others = 0;
    std::vector<ProcessUse> processes;  // set_processes's
    std::map<std::uintptr_t, std::size_t> imported;  // opened from other processes: address -> bytes
    std::map<std::uintptr_t, std::uint64_t> contents;  // write()'s values, on mapped pages
  };

  // The device, made on first use; DeviceError for an index outside 0..device_count()-1.
  Device& device_locked(int device) const;
  std::uintptr_t region_base(int device, bool ranges) const;
  AddressSpace fresh_region(int device, bool ranges) const;
  bool should_fail(int device, std::size_t bytes);
  void add_in_use(Device& d, std::size_t bytes);
  std::size_t free_of(const Device& d) const;
  // Pages [first, first + count) of one reserved range.
  struct PageSpan {
    Range* range = nullptr;
    std::size_t first = 0;
    std::size_t count = 0;
    std::size_t mapped() const;
    void mark(bool mapped) const;
    bool whole_mappings() const;
  };
  bool is_mapped_locked(const Device& d, std::uintptr_t addr) const;
  PageSpan pages_of(int device, void* ptr, std::size_t bytes, const char* call);

  mutable std::mutex mutex_;
  std::size_t capacity_;
  std::uintptr_t span_;  // each region's size
  int device_count_;
  mutable std::vector<std::unique_ptr<Device>> devices_;  // made on first use
  std::unordered_map<EventId, Event> events_;
  std::uintptr_t next_event_ = 1;
  int fail_next_ = 0;
  double fail_probability_ = 0.0;
  std::mt19937 rng_;
  std::function<bool(int, std::size_t)> fail_predicate_;
  int auto_complete_after_ = 0;
  std::size_t page_ = 0;  // 0: no virtual memory
  bool refuse_addresses_ = false;
  bool refuse_markers_ = false;
  bool process_accounting_ = true;
  bool refuse_imports_ = false;
  CaptureMarker next_marker_ = 1;
};

}  // namespace gpumem
