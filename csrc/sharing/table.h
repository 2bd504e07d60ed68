// The shared table of one GPU: a file under the run directory, mapped by every gpumem process of
// one user that shares the GPU (docs/design.md, "Sharing one GPU between processes").
//
// Layout: a header and kSlots slots. Who owns a slot is the kernel's word, not the table's: the
// owner holds an open-file-description lock on the slot's byte (kLockBase + index) for as long as
// it lives, so a slot is owned exactly while its owner's file is open, in any pid namespace, and
// a process killed at any point frees it. A slot whose byte nobody locks is free, whatever it
// holds; only the owner writes its slot's identity and figures (and rewrites them each round);
// askers only add to `asks`. Invariants, per slot:
//   byte unlocked   => nobody reads its figures, and a claimer may take it
//   served          is the asks value the owner last answered (32-bit, wrapping)
//   wanted          is added to before asks is, so an answer to an ask takes at least its bytes
// Nobody ever holds a lock inside the mapping, and every access to it runs under a guard that
// turns a fault (the file truncated under the mapping) into a failed call: a damaged table makes
// the members rejoin a fresh one, never crash.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <sys/types.h>
#include <utility>
#include <vector>

namespace gpumem {

struct alignas(128) ShareSlot {
  std::atomic<std::uint32_t> pid;  // the owner's pid, in its own pid namespace (for people)
  std::atomic<std::uint32_t> uid;
  std::atomic<std::uint64_t> pid_ns;  // the inode of the owner's pid namespace
  std::atomic<std::uint64_t> token;   // the owner's random mark: a slot rewritten by others has another
  std::atomic<std::uint64_t> floor;
  std::atomic<std::uint64_t> reserved;
  std::atomic<std::uint64_t> in_use;
  std::atomic<std::uint32_t> asks;    // futex word: askers add one and wake the owner
  std::atomic<std::uint32_t> served;  // the asks value the owner last answered
  std::atomic<std::uint64_t> wanted;  // bytes askers want given back (saturating; the owner takes it)
  std::atomic<std::uint64_t> asks_served;  // requests answered (a counter, never wraps in practice)
  std::atomic<std::uint64_t> given_back;   // bytes released on request
  std::atomic<std::uint64_t> asks_made;    // requests this owner made of the others
};

struct ShareHeader {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t slots;
  std::uint64_t generation;  // random, stamped when the table is made: a table made afresh has another
};

// What the table's file must be to be trusted: a regular file owned by `uid`, mode 0600 or
// stricter, not a link. Returns "" if so, else why not (for the message). The directory is the
// caller's to trust (gpumem.published's rule, shared with the published figures and `gpumem top`).
std::string share_file_problem(const struct stat& info, unsigned uid);

// Another member's slot as a reader copied it, every figure bounded by `bound` (the device).
struct SlotCopy {
  std::uint32_t index = 0;
  std::uint32_t pid = 0;
  bool same_pid_namespace = true;
  std::size_t floor = 0, reserved = 0, in_use = 0;
  std::uint32_t asks = 0, served = 0;
};

// This member's own figures, as it writes them each round.
struct OwnFigures {
  std::size_t floor = 0, reserved = 0, in_use = 0;
};

// This member's counters, as read back.
struct OwnCounters {
  std::uint64_t asks_served = 0, given_back = 0, asks_made = 0;
};

struct ShareError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One process's handle on a table (a process may hold several: tests do). Each call that touches
// the mapping returns false (or nothing) instead of faulting when the file was cut under it;
// damaged() then says why, and the member rejoins (a new handle).
class ShareTable {
 public:
  static constexpr std::uint32_t kSlots = 64;
  static constexpr off_t kLockBase = 1 << 20;  // slot i's lock byte: kLockBase + i (past the end)

  // Opens the table at `path`, making it (or a fresh one, where the file is not a whole table) under
  // the file's creation lock, waited for at most `lock_wait`. Throws ShareError saying why it cannot
  // be trusted, opened or made.
  explicit ShareTable(const std::string& path, std::chrono::milliseconds lock_wait = std::chrono::seconds(2));
  ~ShareTable();
  ShareTable(const ShareTable&) = delete;
  ShareTable& operator=(const ShareTable&) = delete;

  const std::string& path() const { return path_; }

  // Claims a free slot for this process (`pid` as people see it); kSlots if every slot is owned.
  std::uint32_t claim(std::uint32_t pid);
  // Frees the slot (this handle's own).
  void release(std::uint32_t index);
  // Whether the slot is owned, by another handle than this one.
  bool owned_by_another(std::uint32_t index) const;

  // ---- the owner ----
  // Writes its identity (when another rewrote it) and figures; false on a fault.
  bool publish(std::uint32_t index, const OwnFigures& figures);
  bool count(std::uint32_t index, std::uint64_t asks_served, std::uint64_t given_back, std::uint64_t asks_made);
  bool read_counters(std::uint32_t index, OwnCounters& out);
  // The asks value now (false on a fault), and the answer to it.
  bool asks_of(std::uint32_t index, std::uint32_t& asks);
  // The bytes wanted of it since it last took them (SIZE_MAX: all its cache), now 0; false on a fault.
  bool take_wanted(std::uint32_t index, std::size_t& bytes);
  bool mark_served(std::uint32_t index, std::uint32_t asks);
  // Sleeps until the slot is asked again (its asks leave `seen`), at most `timeout`.
  void wait_for_ask(std::uint32_t index, std::uint32_t seen, std::chrono::milliseconds timeout);
  void wake(std::uint32_t index);

  // ---- the others ----
  // Copies of every owned slot but `except`, figures bounded by `bound`; false on a fault.
  bool read_others(std::uint32_t except, std::size_t bound, std::vector<SlotCopy>& out);
  // Asks slot `index` for `bytes` of its cache (SIZE_MAX: all of it): adds them to what it is
  // wanted, one to its asks, and wakes its owner; the asks value to wait for.
  bool ask(std::uint32_t index, std::size_t bytes, std::uint32_t& wanted);
  // Whether slot `index` has answered `wanted`; false on a fault.
  bool served(std::uint32_t index, std::uint32_t& served);

  // ---- the file ----
  // "" while the file is the whole table this handle mapped; else why not (cut, replaced,
  // removed, another header, made afresh by another process). One fstat and one stat.
  std::string damaged();
  // Runs `grant` under the table's creation lock, waited for at most the handle's lock wait
  // (ShareError past it): floors are granted one at a time, so that they add up.
  template <class F>
  void exclusively(F&& grant) {
    const Exclusive held(*this);
    grant();
  }

 private:
  struct Exclusive {
    explicit Exclusive(ShareTable& table);
    ~Exclusive();
    ShareTable& table;
    std::lock_guard<std::mutex> threads;
  };
  struct Owned {
    std::uint32_t index;
    std::uint32_t pid;
  };
  ShareSlot* slot(std::uint32_t index) { return &slots_[index % kSlots]; }
  void open_or_make();
  bool header_whole() const;
  bool owned_by_this(std::uint32_t index) const;

  std::string path_;
  std::chrono::milliseconds lock_wait_;
  int fd_ = -1;
  void* map_ = nullptr;
  std::size_t bytes_ = 0;
  ShareSlot* slots_ = nullptr;
  struct stat identity_ {};  // the file's device and inode, as opened
  std::uint64_t pid_ns_ = 0;
  std::uint64_t token_ = 0;
  std::uint64_t generation_ = 0;  // the table's generation, as opened
  std::vector<Owned> owned_;  // the slots this handle claimed (one, but for tests)
  std::mutex exclusive_mutex_;
  int opened_by_ = 0;  // the pid that opened it: a forked child neither closes nor unlocks it
};

// The layout, for the tests that write a table as a hostile process would.
struct ShareLayout {
  std::size_t header_bytes, slot_bytes, slots;
  std::vector<std::pair<std::string, std::size_t>> fields;  // name, offset in a slot
};
ShareLayout share_layout();

}  // namespace gpumem
