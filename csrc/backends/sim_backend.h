// A simulated device: hands out non-overlapping fake addresses from a fixed capacity, never touches
// memory (a trace that peaked at 80 GB replays on a laptop), and can be told to refuse requests
// (fault injection). It also keeps its own account of what it handed out, which tests use to check
// the allocator's cap independently of the allocator's statistics.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <unordered_map>
#include <vector>

#include "core/backend.h"

namespace gpumem {

class SimBackend : public Backend {
 public:
  // `capacity` bytes on each of `devices` devices.
  explicit SimBackend(std::size_t capacity, int devices = 1);

  int device_count() const override { return static_cast<int>(devices_.size()); }
  void* reserve(int device, std::size_t bytes) override;
  void release(int device, void* ptr, std::size_t bytes) override;
  MemInfo mem_info(int device) override;
  EventId record_event(int device, StreamId stream) override;
  bool event_done(int device, EventId event) override;
  void destroy_event(int device, EventId event) override;
  void synchronize(int device) override;

  // Fault injection. A request is refused when any of these says so.
  void fail_next(int count);                      // refuse the next `count` reserve calls
  void fail_randomly(double probability, std::uint32_t seed);
  void fail_when(std::function<bool(int device, std::size_t bytes)> predicate);
  void stop_failing();

  // Events complete when the device is synchronized, when complete_events() is called, or (with
  // auto_complete_after(n)) on their n-th query. By default they never complete on their own.
  void complete_events();
  void auto_complete_after(int queries);

  // The backend's own ledger.
  struct Ledger {
    std::size_t in_use = 0;      // bytes handed out now
    std::size_t peak = 0;        // most bytes handed out at once
    std::uint64_t reserves = 0;  // successful reserve calls
    std::uint64_t releases = 0;
    std::uint64_t refusals = 0;
    std::uint64_t syncs = 0;
    std::size_t live_events = 0;
  };
  Ledger ledger(int device) const;
  void reset_peak(int device);

 private:
  struct Event {
    int device = 0;
    bool done = false;
    int queries = 0;
  };
  struct Device {
    std::uintptr_t base = 0;
    std::uintptr_t next = 0;                             // bump pointer
    std::map<std::uintptr_t, std::size_t> holes;         // released address ranges, by address
    std::unordered_map<std::uintptr_t, std::size_t> live;  // address -> size
    Ledger ledger;
  };

  Device& device_locked(int device);
  const Device& device_locked(int device) const;
  bool should_fail(int device, std::size_t bytes);
  std::uintptr_t take_address(Device& d, std::size_t bytes);
  void return_address(Device& d, std::uintptr_t addr, std::size_t bytes);

  mutable std::mutex mutex_;
  std::size_t capacity_;
  std::vector<Device> devices_;
  std::unordered_map<EventId, Event> events_;
  std::uintptr_t next_event_ = 1;
  int fail_next_ = 0;
  double fail_probability_ = 0.0;
  std::mt19937 rng_;
  std::function<bool(int, std::size_t)> fail_predicate_;
  int auto_complete_after_ = 0;
};

}  // namespace gpumem
