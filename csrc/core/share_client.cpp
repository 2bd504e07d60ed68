// One process's member of a shared GPU: publishing, answering, asking, the shared ceiling.
#include "core/share_client.h"

#include <algorithm>
#include <climits>
#include <ctime>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/cap.h"
#include "core/device_allocator.h"
#include "core/device_state.h"
#include "core/errors.h"

namespace gpumem {

namespace {

// The futex calls on a word of the shared mapping (not FUTEX_PRIVATE: other processes wait too).
std::uint32_t* word(std::atomic<std::uint32_t>& a) { return reinterpret_cast<std::uint32_t*>(&a); }

void futex_wait(std::atomic<std::uint32_t>& a, std::uint32_t seen, std::chrono::milliseconds timeout) {
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000) * 1000000);
  ::syscall(SYS_futex, word(a), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(std::atomic<std::uint32_t>& a) { ::syscall(SYS_futex, word(a), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

// Whether `served` has reached `wanted` (both wrap at 2^32).
bool reached(std::uint32_t served, std::uint32_t wanted) { return static_cast<std::int32_t>(served - wanted) >= 0; }

}  // namespace

// ---- DeviceHost: the responder's calls into its own device ----

std::size_t DeviceHost::reserved() { return device_.reserved(); }
std::size_t DeviceHost::in_use() {
  const std::int64_t bytes = device_.stats().allocated_bytes[kAll].current;
  return bytes > 0 ? static_cast<std::size_t>(bytes) : 0;
}
std::size_t DeviceHost::give_back() {
  const std::size_t before = device_.reserved();
  device_.empty_cache();
  const std::size_t after = device_.reserved();
  return before > after ? before - after : 0;
}
void DeviceHost::set_ceiling(std::size_t bytes) { device_.set_shared_ceiling(bytes); }
MemInfo DeviceHost::mem_info() { return device_.device_mem_info(); }

// ---- the member ----

ShareClient::ShareClient(std::unique_ptr<ShareTable> table, ShareHost& host, std::size_t device_total,
                         ShareOptions options, std::uint32_t pid)
    : table_(std::move(table)), host_(host), total_(device_total), options_(options) {
  const std::uint32_t me = pid != 0 ? pid : static_cast<std::uint32_t>(::getpid());
  index_ = table_->claim(me, process_start_time(me), static_cast<std::uint32_t>(::geteuid()));
  if (index_ >= ShareTable::kSlots) {
    throw ShareError("gpumem: sharing: " + table_->path() + " has no free slot (" +
                     std::to_string(ShareTable::kSlots) + " processes share the GPU already); not sharing");
  }
}

ShareClient::~ShareClient() {
  stop();
  table_->release(index_);
}

void ShareClient::start() {
  if (responder_.joinable()) return;
  stopping_.store(false);
  responder_ = std::thread([this] { respond_loop(); });
}

void ShareClient::stop() {
  if (!responder_.joinable()) return;
  stopping_.store(true);
  futex_wake(mine().asks);
  responder_.join();
}

void ShareClient::publish(std::size_t reserved, std::size_t in_use) {
  mine().reserved.store(reserved, std::memory_order_relaxed);
  mine().in_use.store(in_use, std::memory_order_relaxed);
}

ShareTally ShareClient::tally_others() {
  ShareTally tally;
  table_->for_each_live(index_, [&](std::uint32_t, ShareSlot& s) {
    tally.add({s.floor.load(std::memory_order_relaxed), s.reserved.load(std::memory_order_relaxed),
               s.in_use.load(std::memory_order_relaxed)});
  });
  return tally;
}

std::size_t ShareClient::ceiling_now() {
  return share_ceiling(total_, unaccounted_.load(std::memory_order_relaxed), tally_others());
}

// Under the whole device: a fresh reading of the device (not while a graph may be capturing: the
// last reading stands), published, and the ceiling it gives put in the cap.
void ShareClient::refresh_from_device(DeviceState& d) {
  const std::size_t reserved = d.cap.reserved();
  const std::int64_t live = d.stats.allocated_bytes();
  publish(reserved, live > 0 ? static_cast<std::size_t>(live) : 0);
  const ShareTally others = tally_others();
  if (!d.capturing()) {
    const MemInfo mem = d.backend.mem_info(d.device);
    unaccounted_.store(unaccounted(total_, mem.free, reserved, others), std::memory_order_relaxed);
  }
  const std::size_t ceiling = share_ceiling(total_, unaccounted_.load(std::memory_order_relaxed), others);
  d.cap.set_ceiling(ceiling);
  ceiling_.store(ceiling, std::memory_order_relaxed);
}

void ShareClient::before_growth(DeviceState& d, std::size_t allocated, std::size_t size) noexcept {
  try {
    refresh_from_device(d);
    const bool hard_cap_allows = fits_under(allocated, size, d.cap.hard_budget());
    if (!hard_cap_allows || fits_under(allocated, size, d.cap.budget())) return;
    if (ask_others()) refresh_from_device(d);
  } catch (...) {
    // A reading that failed leaves the last ceiling: the device still refuses what it cannot give.
  }
}

bool ShareClient::retry_after_refusal(DeviceState& d) noexcept {
  try {
    if (!ask_others()) return false;
    refresh_from_device(d);
    return true;
  } catch (...) {
    return false;
  }
}

bool ShareClient::ask_others() {
  struct Asked {
    ShareSlot* slot;
    std::uint32_t pid;
    std::uint32_t wanted;
  };
  std::vector<Asked> asked;
  table_->for_each_live(index_, [&](std::uint32_t, ShareSlot& s) {
    const std::uint32_t wanted = s.asks.fetch_add(1, std::memory_order_acq_rel) + 1;
    futex_wake(s.asks);
    asked.push_back({&s, s.pid.load(std::memory_order_relaxed), wanted});
  });
  mine().asks_made.fetch_add(1, std::memory_order_relaxed);
  if (asked.empty()) return false;
  const auto deadline = std::chrono::steady_clock::now() + options_.ask_wait;
  for (;;) {
    bool all = true;
    for (const Asked& a : asked) {
      // An answer, or a member that went away (its memory went with it), ends the wait for it.
      const bool gone = a.slot->pid.load(std::memory_order_acquire) != a.pid || !process_alive(a.pid, 0);
      if (!gone && !reached(a.slot->served.load(std::memory_order_acquire), a.wanted)) all = false;
    }
    if (all || std::chrono::steady_clock::now() >= deadline) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void ShareClient::answer(std::uint32_t asks) {
  const std::lock_guard<std::mutex> guard(answering_);
  if (reached(mine().served.load(std::memory_order_relaxed), asks)) return;
  const std::size_t given = host_.give_back();
  publish(host_.reserved(), host_.in_use());
  mine().given_back.fetch_add(given, std::memory_order_relaxed);
  mine().asks_served.fetch_add(1, std::memory_order_relaxed);
  mine().served.store(asks, std::memory_order_release);
}

void ShareClient::follow_now() {
  const std::uint32_t asks = mine().asks.load(std::memory_order_acquire);
  if (asks != mine().served.load(std::memory_order_acquire)) answer(asks);
  publish(host_.reserved(), host_.in_use());
  const std::size_t ceiling = ceiling_now();
  if (ceiling != ceiling_.load(std::memory_order_relaxed)) {
    host_.set_ceiling(ceiling);
    ceiling_.store(ceiling, std::memory_order_relaxed);
  }
}

// The responder: answers requests, publishes its figures and follows the others' floors. What
// the device allocator throws here (a broken driver) must not end the process: it is dropped,
// and the next round tries again.
void ShareClient::respond_loop() {
  while (!stopping_.load()) {
    try {
      const std::uint32_t asks = mine().asks.load(std::memory_order_acquire);
      if (asks == mine().served.load(std::memory_order_acquire)) futex_wait(mine().asks, asks, options_.poll);
      if (stopping_.load()) break;
      follow_now();
    } catch (...) {
      std::this_thread::sleep_for(options_.poll);
    }
  }
}

std::size_t ShareClient::set_floor(std::size_t bytes) {
  floor_.store(bytes, std::memory_order_relaxed);
  mine().floor.store(bytes, std::memory_order_release);
  auto shortfall = [&] {
    const std::size_t reserved = host_.reserved();
    publish(reserved, host_.in_use());
    const ShareTally others = tally_others();
    unaccounted_.store(unaccounted(total_, host_.mem_info().free, reserved, others), std::memory_order_relaxed);
    const std::size_t room = std::max(reserved, share_room(total_, unaccounted_.load(std::memory_order_relaxed), others));
    return bytes > room ? bytes - room : 0;
  };
  // The others answer with fresh figures, and their free cache first goes back for the floor.
  if (bytes > 0) ask_others();
  return shortfall();
}

ShareStatus ShareClient::status() {
  ShareStatus s;
  s.floor = floor();
  s.ceiling = ceiling_.load(std::memory_order_relaxed);
  const std::size_t reserved = host_.reserved();
  s.borrowed = borrowed(reserved, s.floor);
  // What this member holds already is honoured, whatever a stale figure of another says.
  const std::size_t room =
      std::max(reserved, share_room(total_, unaccounted_.load(std::memory_order_relaxed), tally_others()));
  s.floor_short = s.floor > room ? s.floor - room : 0;
  s.asks_made = mine().asks_made.load(std::memory_order_relaxed);
  s.asks_served = mine().asks_served.load(std::memory_order_relaxed);
  s.given_back = mine().given_back.load(std::memory_order_relaxed);
  table_->for_each_live(index_, [&](std::uint32_t, ShareSlot& o) {
    s.others.push_back({o.pid.load(std::memory_order_relaxed), o.floor.load(std::memory_order_relaxed),
                        o.reserved.load(std::memory_order_relaxed), o.in_use.load(std::memory_order_relaxed)});
  });
  return s;
}

// The members of the table by pid, then the processes the driver lists that are not members
// (native PyTorch, another user's or another table's): those could not be asked, and are named
// with what they hold. Where the driver lists none, what no member accounts for is one figure.
std::string ShareClient::describe(const std::vector<ProcessUse>& on_device) const noexcept {
  try {
    std::string text = " Sharing the GPU (" + table_->path() + "): the others' floors and live tensors leave this process " +
                       format_bytes(ceiling_.load()) + ";";
    std::vector<std::uint32_t> members{table_->slot(index_).pid.load()};
    table_->for_each_live(index_, [&](std::uint32_t, ShareSlot& o) {
      members.push_back(o.pid.load());
      text += " pid " + std::to_string(o.pid.load()) + " reserves " + format_bytes(o.reserved.load()) + " (" +
              format_bytes(o.in_use.load()) + " in use, floor " + format_bytes(o.floor.load()) + ", asked);";
    });
    if (members.size() == 1) text += " no other gpumem process;";
    std::string not_asked;
    for (const ProcessUse& p : on_device) {
      if (std::find(members.begin(), members.end(), p.pid) != members.end()) continue;
      not_asked += " pid " + std::to_string(p.pid) + " holds " + format_bytes(p.bytes) + ";";
    }
    if (!not_asked.empty()) {
      text += " not in this table, so not asked (native PyTorch, other users' or other tables' processes, as the "
              "driver lists them):" + not_asked;
    }
    text += " " + format_bytes(unaccounted_.load()) +
            " is held outside every gpumem process of this table (CUDA contexts, native PyTorch or other users' "
            "processes: these could not be asked).";
    return text;
  } catch (...) {
    return "";
  }
}

}  // namespace gpumem
