// One process's member of a shared GPU's table (docs/design.md, "Sharing one GPU between
// processes"): its slot and what it publishes there, the responder thread that answers the
// others' requests by giving back free cache and keeps the ceiling their floors leave in the
// device's cap, asking the others (with no allocator lock held) and waiting a bounded time, and
// the floors, granted one at a time so that they add up.
//
// Files a newcomer reads to follow an ask: core/device_core.cpp (a request that needs the others
// leaves the device and calls ShareHooks::ask), core/share_hooks.h, this file's member.cpp (ask,
// answer), sharing/table.cpp (the slot's counters and the futex).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "core/backend.h"
#include "core/share_hooks.h"
#include "sharing/policy.h"
#include "sharing/table.h"

namespace gpumem {

class DeviceAllocator;

// What the member may do to its own device, with no lock held: the device allocator's public calls
// (DeviceHost), or a test's fake.
class ShareHost {
 public:
  virtual ~ShareHost() = default;
  virtual std::size_t reserved() = 0;
  virtual std::size_t in_use() = 0;
  // Gives back free cached memory only: `bytes` of it, largest first (SIZE_MAX: all of it, as
  // empty_cache does); returns the bytes that went.
  virtual std::size_t give_back(std::size_t bytes) = 0;
  virtual void set_ceiling(std::size_t bytes) = 0;
  // The device's figures; nullopt while a graph may be capturing (the call is not allowed then).
  virtual std::optional<MemInfo> mem_info() = 0;
};

class DeviceHost final : public ShareHost {
 public:
  explicit DeviceHost(DeviceAllocator& device) : device_(device) {}
  std::size_t reserved() override;
  std::size_t in_use() override;
  std::size_t give_back(std::size_t bytes) override;
  void set_ceiling(std::size_t bytes) override;
  std::optional<MemInfo> mem_info() override;

 private:
  DeviceAllocator& device_;
};

struct ShareOptions {
  std::chrono::milliseconds ask_wait{500};   // how long an asker waits for the others to answer
  std::chrono::milliseconds poll{20};        // the responder's round: publish, follow, check the file
  std::chrono::milliseconds lock_wait{2000};  // the table's creation (and floor) lock, at most
};

// One live member as a view shows it.
struct ShareMemberView {
  std::uint32_t pid = 0;
  bool same_pid_namespace = true;
  std::size_t floor = 0, reserved = 0, in_use = 0;
};

struct ShareStatus {
  std::size_t floor = 0;
  std::size_t ceiling = 0;         // the shared ceiling in effect (SIZE_MAX: none)
  std::size_t borrowed = 0;        // reserved above the floor
  std::size_t floor_short = 0;     // how much of the floor the device cannot give now
  std::uint64_t asks_made = 0;     // requests this process made of the others
  std::uint64_t asks_served = 0;   // the others' requests it answered
  std::uint64_t given_back = 0;    // bytes it released on request
  std::uint64_t asks_timed_out = 0;  // its requests that some member let pass the wait unanswered
  std::string problem;             // "" while the table is whole; else why this member is alone now
  std::vector<ShareMemberView> others;
};

// What set_floor granted.
struct FloorGrant {
  std::size_t asked = 0;
  std::size_t granted = 0;     // asked, or less where the others' floors leave less of the device
  std::size_t short_now = 0;   // of granted, what the others' live tensors hold now (honoured as they free)
  std::vector<ShareMemberView> floor_holders;  // the others with a floor
};

class ShareClient final : public ShareHooks {
 public:
  // Joins the table at `path` (ShareError saying why it cannot: untrusted, full, its lock held) as
  // `pid` (this process unless a test says otherwise); starts no thread.
  ShareClient(const std::string& path, ShareHost& host, std::size_t device_total, ShareOptions options = {},
              std::uint32_t pid = 0);
  ~ShareClient() override;
  ShareClient(const ShareClient&) = delete;
  ShareClient& operator=(const ShareClient&) = delete;

  void start();  // the responder thread
  void stop();   // joins it; the slot stays until the destructor

  // Grants the floor (ShareError if the table's lock cannot be had), having asked the others for
  // their free cache for it.
  FloorGrant set_floor(std::size_t bytes);
  std::size_t floor() const { return floor_.load(std::memory_order_relaxed); }
  ShareStatus status();
  // Asks the other members to give back free cache and waits, at most options.ask_wait, for those
  // that answer; false if there was nobody to ask. With `device_bytes` (a request the device
  // refused), only what the device lacks, of the members caching most first, and the wait also
  // ends once `still_needed` reports 0 (Note [handing memory over while it is released]); else all
  // of their cache.
  bool ask_others(std::size_t device_bytes = 0, const StillNeeded& still_needed = {});
  // One round of the responder, without waiting: checks the file (rejoining a fresh table where it
  // was damaged), answers the requests made so far, publishes this member's figures and follows the
  // others' floors (the ceiling). Tests call it to settle.
  void follow_now();

  void ask(const AskFor& need, const StillNeeded& still_needed) noexcept override;
  std::string describe(const std::vector<ProcessUse>& on_device) const noexcept override;

  std::string table_path() const { return path_; }
  std::uint32_t slot_index() const;

 private:
  struct Joined {
    std::shared_ptr<ShareTable> table;
    std::uint32_t index = ShareTable::kSlots;
  };
  Joined joined() const;
  void join();
  bool forked() const { return static_cast<int>(::getpid()) != process_; }
  std::vector<SlotCopy> others(const Joined& j) const;
  void publish(const Joined& j);
  std::size_t refresh_ceiling(const Joined& j);
  std::size_t measure_unaccounted(const ShareTally& others);
  std::size_t shortfall(std::size_t floor, std::size_t unaccounted_bytes, const ShareTally& others);
  void set_ceiling(std::size_t ceiling);
  FloorGrant grant(const Joined& j, std::size_t bytes);
  struct Asked {
    std::uint32_t index;
    std::uint32_t wanted;  // the asks value whose answer is waited for
  };
  // Asks the others (all their cache, or `lacking` bytes split over them by what they cache) and
  // returns those to wait for.
  std::vector<Asked> ask_round(const Joined& j, const std::vector<SlotCopy>& copies, std::size_t lacking);
  // How an ask hands memory over: `still_needed` maps what the device holds of the request
  // (nullptr: nothing is mapped ahead), once `on` (the others' cache holds what it lacks).
  struct Handover {
    const StillNeeded* still_needed = nullptr;
    bool on = false;
  };
  bool wait_for(const Joined& j, std::vector<Asked>& waited, std::chrono::steady_clock::time_point deadline,
                Handover& handover, std::size_t& lacking);
  void rejoin(const std::string& why);
  void respond_loop();

  const std::string path_;
  ShareHost& host_;
  const std::size_t total_;
  const ShareOptions options_;
  const std::uint32_t pid_;
  const int process_;  // getpid() at the join: Note [a forked child is not a member] (sharing/table.cpp)
  mutable std::mutex joined_mutex_;  // guards joined_ (the responder swaps it when it rejoins)
  Joined joined_;
  std::atomic<std::size_t> floor_{0};
  std::atomic<std::size_t> floor_asked_{0};  // what set_floor asked for: granted again on a rejoin
  std::mutex ceiling_mutex_;  // one refresh at a time: the cap and ceiling_ never disagree
  std::atomic<std::size_t> unaccounted_{0};
  std::atomic<std::size_t> ceiling_{SIZE_MAX};
  std::atomic<std::uint64_t> asks_made_{0}, asks_served_{0}, given_back_{0}, asks_timed_out_{0};
  std::atomic<bool> stopping_{false};
  std::thread responder_;
  std::mutex answering_;  // the responder and follow_now answer one at a time
  std::atomic<std::uint32_t> answered_{0};  // the asks value last answered: this process's own record
  std::mutex problem_mutex_;
  std::string problem_;
  // Members that let an ask of this one time out, by slot: not waited for again until they answer.
  std::mutex slow_mutex_;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> slow_;  // slot, the asks value that went unanswered
};

}  // namespace gpumem
