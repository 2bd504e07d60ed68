// One process's member of a shared GPU's table (docs/design.md, "Sharing one GPU between
// processes"): its slot and what it publishes there, the responder thread that answers the
// others' requests by giving back free cache, asking the others and waiting a bounded time, and
// the shared ceiling (core/share_policy.h) it keeps in the device's Cap.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.h"
#include "core/share_hooks.h"
#include "core/share_policy.h"
#include "core/share_table.h"

namespace gpumem {

class DeviceAllocator;

// What the responder thread may do to its own device, with no lock held: the device allocator's
// public calls (DeviceHost), or a test's fake.
class ShareHost {
 public:
  virtual ~ShareHost() = default;
  virtual std::size_t reserved() = 0;
  virtual std::size_t in_use() = 0;
  // Gives back free cached memory only (empty_cache); returns the bytes that went.
  virtual std::size_t give_back() = 0;
  virtual void set_ceiling(std::size_t bytes) = 0;
  virtual MemInfo mem_info() = 0;
};

class DeviceHost final : public ShareHost {
 public:
  explicit DeviceHost(DeviceAllocator& device) : device_(device) {}
  std::size_t reserved() override;
  std::size_t in_use() override;
  std::size_t give_back() override;
  void set_ceiling(std::size_t bytes) override;
  MemInfo mem_info() override;

 private:
  DeviceAllocator& device_;
};

struct ShareOptions {
  std::chrono::milliseconds ask_wait{500};  // how long an asker waits for the others to answer
  std::chrono::milliseconds poll{20};       // the responder's sleep between publications
};

// One live member as a view shows it.
struct ShareMemberView {
  std::uint32_t pid = 0;
  std::size_t floor = 0, reserved = 0, in_use = 0;
};

struct ShareStatus {
  std::size_t floor = 0;
  std::size_t ceiling = 0;         // the shared ceiling in effect (SIZE_MAX before the first)
  std::size_t borrowed = 0;        // reserved above the floor
  std::size_t floor_short = 0;     // how much of the floor the device cannot give now
  std::uint64_t asks_made = 0;     // requests this process made of the others
  std::uint64_t asks_served = 0;   // the others' requests it answered
  std::uint64_t given_back = 0;    // bytes it released on request
  std::vector<ShareMemberView> others;
};

class ShareClient final : public ShareHooks {
 public:
  // Claims a slot in `table` (ShareError if it is full) for `pid` (this process unless a test
  // says otherwise); starts no thread.
  ShareClient(std::unique_ptr<ShareTable> table, ShareHost& host, std::size_t device_total,
              ShareOptions options = {}, std::uint32_t pid = 0);
  ~ShareClient() override;
  ShareClient(const ShareClient&) = delete;
  ShareClient& operator=(const ShareClient&) = delete;

  void start();  // the responder thread
  void stop();   // joins it; the slot stays until the destructor

  // Sets the floor; returns how much of it the device cannot give now (0: honoured), having asked
  // the others (a bounded wait) for fresh figures and to give back their free cache for it.
  std::size_t set_floor(std::size_t bytes);
  std::size_t floor() const { return floor_.load(std::memory_order_relaxed); }
  ShareStatus status();
  // Asks every other member to give back free cache and waits, at most options.ask_wait, for each
  // to answer; false if there was nobody to ask.
  bool ask_others();
  // One round of the responder, without waiting: answers the requests made so far, publishes this
  // member's figures and follows the others' floors (the ceiling). Tests call it to settle.
  void follow_now();

  void before_growth(DeviceState& d, std::size_t allocated, std::size_t size) noexcept override;
  bool retry_after_refusal(DeviceState& d) noexcept override;
  std::string describe(const std::vector<ProcessUse>& on_device) const noexcept override;

  ShareTable& table() { return *table_; }

 private:
  ShareSlot& mine() { return table_->slot(index_); }
  void publish(std::size_t reserved, std::size_t in_use);
  ShareTally tally_others();
  // The ceiling from the table and the last reading of the device's unaccounted memory.
  std::size_t ceiling_now();
  void refresh_from_device(DeviceState& d);
  void respond_loop();
  void answer(std::uint32_t asks);

  std::unique_ptr<ShareTable> table_;
  ShareHost& host_;
  const std::size_t total_;
  const ShareOptions options_;
  std::uint32_t index_;
  std::atomic<std::size_t> floor_{0};
  std::atomic<std::size_t> unaccounted_{0};
  std::atomic<std::size_t> ceiling_{SIZE_MAX};
  std::atomic<bool> stopping_{false};
  std::thread responder_;
  std::mutex answering_;  // the thread and answer_now answer one at a time
};

}  // namespace gpumem
