// The shared table of one GPU: a file under the run directory, mapped by every gpumem process of
// one user that shares the GPU (docs/design.md, "Sharing one GPU between processes").
//
// Layout: a header and kSlots slots. A slot is free (pid 0), being claimed or dropped (pid
// kBusy), or owned (pid > 0). Only the owner writes its figures; askers only add to `asks`.
// Invariants, per slot:
//   pid == 0        => nobody reads its figures
//   served <= asks  (32-bit, wrapping: served is the asks value the owner last answered)
// Nobody ever holds a lock inside the mapping, so a process killed at any point blocks nobody.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <sys/stat.h>

namespace gpumem {

struct alignas(128) ShareSlot {
  std::atomic<std::uint32_t> pid;
  std::atomic<std::uint32_t> uid;
  std::atomic<std::uint64_t> start_time;  // clock ticks after boot, /proc/<pid>/stat field 22
  std::atomic<std::uint64_t> floor;
  std::atomic<std::uint64_t> reserved;
  std::atomic<std::uint64_t> in_use;
  std::atomic<std::uint32_t> asks;    // futex word: askers add one and wake the owner
  std::atomic<std::uint32_t> served;  // the asks value the owner last answered
  std::atomic<std::uint64_t> asks_served;  // requests answered (a counter, never wraps in practice)
  std::atomic<std::uint64_t> given_back;   // bytes released on request
  std::atomic<std::uint64_t> asks_made;    // requests this owner made of the others
};

struct ShareHeader {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t slots;
};

// What the table's file must be to be trusted: a regular file owned by `uid`, mode 0600 or
// stricter, not a link. Returns "" if so, else why not (for the message).
std::string share_file_problem(const struct stat& info, unsigned uid);
// The directory holding it: owned by `uid`, not writable by group or others.
std::string share_dir_problem(const struct stat& info, unsigned uid);

// One process's view of a table (a process may hold several handles: tests do).
class ShareTable {
 public:
  static constexpr std::uint32_t kSlots = 64;
  static constexpr std::uint32_t kBusy = 0xffffffffu;

  // Opens or creates the table at `path`; throws ShareError (a std::runtime_error) saying why it
  // cannot be trusted or opened.
  explicit ShareTable(const std::string& path);
  ~ShareTable();
  ShareTable(const ShareTable&) = delete;
  ShareTable& operator=(const ShareTable&) = delete;

  const std::string& path() const { return path_; }
  ShareSlot& slot(std::uint32_t i) { return slots_[i % kSlots]; }

  // Claims a free slot for this process (after dropping stale ones); kSlots if the table is full.
  std::uint32_t claim(std::uint32_t pid, std::uint64_t start_time, std::uint32_t uid);
  void release(std::uint32_t index);
  // Visits every live slot but `except` (kSlots: none), dropping the stale ones it meets.
  void for_each_live(std::uint32_t except, const std::function<void(std::uint32_t, ShareSlot&)>& visit);

  // Whether the process owning a slot still lives: its pid exists with the same start time. The
  // default reads /proc; tests may replace it.
  using Liveness = std::function<bool(std::uint32_t pid, std::uint64_t start_time)>;
  void set_liveness(Liveness liveness) { liveness_ = std::move(liveness); }

 private:
  bool drop_if_stale(ShareSlot& s, std::uint32_t pid);

  std::string path_;
  int fd_ = -1;
  void* map_ = nullptr;
  std::size_t bytes_ = 0;
  ShareSlot* slots_ = nullptr;
  Liveness liveness_;
};

struct ShareError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A process's start time (clock ticks after boot), 0 if it has gone (a zombie has).
std::uint64_t process_start_time(std::uint32_t pid);
// Whether `pid` lives with that start time (0: any).
bool process_alive(std::uint32_t pid, std::uint64_t start_time);

}  // namespace gpumem
