// The shared table's file (sharing/table.h): trust checks, making it, the slots' owners (the
// kernel's locks), guarded access to the mapping, and what a forked child must not inherit.
#include "sharing/table.h"

#include <cerrno>
#include <climits>
#include <csetjmp>
#include <csignal>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <linux/futex.h>
#include <mutex>
#include <pthread.h>
#include <random>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>

#include "sharing/policy.h"

namespace gpumem {

namespace {

constexpr std::uint64_t kMagic = 0x31726168736d7067ull;  // "gpmshar1"
constexpr std::uint32_t kVersion = 3;  // 2: owners are the kernel's locks; 3: asks say how many bytes
constexpr std::size_t kSlotsOffset = 128;                  // the header, padded to a slot's alignment

std::size_t table_bytes() { return kSlotsOffset + sizeof(ShareSlot) * ShareTable::kSlots; }

std::string octal(unsigned mode) {
  char text[16];
  std::snprintf(text, sizeof text, "%04o", mode & 07777u);
  return text;
}

std::string error_text() { return std::strerror(errno); }

// ---- Note [a table cut under its mapping] ----
// A same-user process may truncate the file while members have it mapped; a load or store in the
// lost pages would raise SIGBUS and end the process. Every access to the mapping runs in guarded():
// a fault there jumps back and the access reports failure, so the member finds the damage and
// rejoins. A SIGBUS outside a guarded access is not gpumem's: the handler puts back the disposition
// it found and returns, and the fault, taken again, goes where it always would have.
__attribute__((tls_model("initial-exec"))) thread_local sigjmp_buf* t_jump = nullptr;
struct sigaction g_previous_bus {};

void on_bus_error(int, siginfo_t* info, void*) {
  if (sigjmp_buf* jump = t_jump) {
    t_jump = nullptr;
    siglongjmp(*jump, 1);
  }
  ::sigaction(SIGBUS, &g_previous_bus, nullptr);
  if (info && info->si_code <= 0) ::raise(SIGBUS);  // sent (kill): it would not come again by itself
}

// The accesses it guards touch atomics of the mapping and plain locals only: nothing whose
// destructor a jump would skip.
template <class F>
bool guarded(F&& access) {
  sigjmp_buf jump;
  sigjmp_buf* const outer = t_jump;
  if (sigsetjmp(jump, 0) != 0) {
    t_jump = outer;
    return false;
  }
  t_jump = &jump;
  access();
  t_jump = outer;
  return true;
}

// ---- Note [a forked child is not a member] ----
// A child made by fork() inherits the table's descriptor and mapping, and with them the file
// description whose locks say its parent owns a slot: the slot would outlive the parent as long
// as the child lives. After fork the child's copy of each table's mapping is replaced by private
// memory and its descriptor pointed at /dev/null, so only the parent holds the file; the child's
// copies of the handles and members do nothing (they check the pid that made them).
constexpr int kForkSlots = 256;
struct Registered {
  std::atomic<int> fd_plus_one{0};  // 0: a free entry
  std::atomic<void*> map{nullptr};
  std::atomic<std::size_t> bytes{0};
};
Registered g_tables[kForkSlots];

void after_fork_in_child() {
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (Registered& entry : g_tables) {
    const int stored = entry.fd_plus_one.exchange(0);
    if (stored <= 0) continue;
    if (void* map = entry.map.exchange(nullptr)) {
      ::mmap(map, entry.bytes.load(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    }
    if (null_fd < 0 || ::dup3(null_fd, stored - 1, O_CLOEXEC) < 0) ::close(stored - 1);
  }
  if (null_fd >= 0) ::close(null_fd);
}

void install_process_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = on_bus_error;
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGBUS, &action, &g_previous_bus);
    ::pthread_atfork(nullptr, nullptr, after_fork_in_child);
  });
}

// At the open, before anything is locked or mapped (a fork may come at any time); the mapping once
// it is made.
void remember(int fd) {
  for (Registered& entry : g_tables) {
    int none = 0;
    if (entry.fd_plus_one.compare_exchange_strong(none, fd + 1)) return;
  }
}

void remember_map(int fd, void* map, std::size_t bytes) {
  for (Registered& entry : g_tables) {
    if (entry.fd_plus_one.load() != fd + 1) continue;
    entry.bytes.store(bytes);
    entry.map.store(map);
    return;
  }
}

void forget(int fd) {
  for (Registered& entry : g_tables) {
    int mine = fd + 1;
    if (entry.fd_plus_one.load() != mine) continue;
    entry.map.store(nullptr);
    entry.fd_plus_one.store(0);
    return;
  }
}

std::uint64_t own_pid_namespace() {
  struct stat info {};
  return ::stat("/proc/self/ns/pid", &info) == 0 ? static_cast<std::uint64_t>(info.st_ino) : 0;
}

std::uint64_t random_token() {
  std::random_device device;
  const std::uint64_t token = (static_cast<std::uint64_t>(device()) << 32) ^ device();
  return token == 0 ? 1 : token;
}

struct flock lock_of(std::uint32_t index, short type) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = ShareTable::kLockBase + static_cast<off_t>(index);
  lock.l_len = 1;
  return lock;
}

std::uint32_t* futex_word(std::atomic<std::uint32_t>& a) { return reinterpret_cast<std::uint32_t*>(&a); }

std::size_t bounded(std::uint64_t value, std::size_t bound) {
  return value > bound ? bound : static_cast<std::size_t>(value);
}

}  // namespace

std::string share_file_problem(const struct stat& info, unsigned uid) {
  if (!S_ISREG(info.st_mode)) return "is not a regular file";
  if (info.st_uid != uid) return "belongs to uid " + std::to_string(info.st_uid) + ", not to this user (uid " +
                                 std::to_string(uid) + ")";
  if (info.st_mode & 077) return "has mode " + octal(info.st_mode) + "; it must be 0600";
  return "";
}

// ---- opening, making ----

ShareTable::ShareTable(const std::string& path, std::chrono::milliseconds lock_wait)
    : path_(path), lock_wait_(lock_wait), opened_by_(static_cast<int>(::getpid())) {
  install_process_handlers();
  pid_ns_ = own_pid_namespace();
  token_ = random_token();
  try {
    open_or_make();
  } catch (...) {
    if (fd_ >= 0) forget(fd_);
    if (map_) ::munmap(map_, bytes_);
    if (fd_ >= 0) ::close(fd_);
    throw;
  }
}

ShareTable::~ShareTable() {
  if (static_cast<int>(::getpid()) != opened_by_) return;  // a forked child's copy: Note [a forked child is not a member]
  forget(fd_);
  if (map_) ::munmap(map_, bytes_);
  if (fd_ >= 0) ::close(fd_);  // frees every slot this handle owned
}

void ShareTable::open_or_make() {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd_ < 0) throw ShareError("gpumem: sharing: cannot open " + path_ + ": " + error_text());
  remember(fd_);
  struct stat info {};
  if (::fstat(fd_, &info) != 0) throw ShareError("gpumem: sharing: cannot read " + path_ + ": " + error_text());
  if (std::string why = share_file_problem(info, ::geteuid()); !why.empty()) {
    throw ShareError("gpumem: sharing: " + path_ + " " + why + "; not sharing");
  }
  bytes_ = table_bytes();
  // Mapping past the file's end is allowed; an access there faults, and is guarded.
  map_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw ShareError("gpumem: sharing: cannot map " + path_ + ": " + error_text());
  }
  remember_map(fd_, map_, bytes_);
  slots_ = reinterpret_cast<ShareSlot*>(static_cast<char*>(map_) + kSlotsOffset);
  auto* header = static_cast<ShareHeader*>(map_);
  auto whole = [&] {
    return static_cast<std::size_t>(info.st_size) == bytes_ && header_whole() &&
           guarded([&] { generation_ = header->generation; });
  };
  if (whole()) {
    identity_ = info;
    return;
  }
  // A new file, or one that is not a whole table (its maker killed half-way, the file cut): made
  // afresh under the creation lock. A table of another gpumem version is left to its members.
  const Exclusive held(*this);
  if (::fstat(fd_, &info) != 0) throw ShareError("gpumem: sharing: cannot read " + path_ + ": " + error_text());
  if (whole()) {
    identity_ = info;
    return;
  }
  std::uint64_t magic = 0;
  std::uint32_t version = 0;
  if (static_cast<std::size_t>(info.st_size) >= sizeof(ShareHeader) &&
      guarded([&] { magic = header->magic, version = header->version; }) && magic == kMagic && version != kVersion) {
    throw ShareError("gpumem: sharing: " + path_ + " is the table of another gpumem version (" + std::to_string(version) +
                     "); not sharing: end the processes of that version that share this GPU, then remove it");
  }
  if (::ftruncate(fd_, 0) != 0 || ::ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) {
    throw ShareError("gpumem: sharing: cannot size " + path_ + ": " + error_text());
  }
  generation_ = random_token();
  const bool written = guarded([&] {
    header->version = kVersion;
    header->slots = kSlots;
    header->generation = generation_;
    header->magic = kMagic;  // zero-filled slots are free slots
  });
  if (!written || ::fstat(fd_, &info) != 0) throw ShareError("gpumem: sharing: " + path_ + " was cut while it was made");
  identity_ = info;
}

bool ShareTable::header_whole() const {
  const auto* header = static_cast<const ShareHeader*>(map_);
  bool whole = false;
  guarded([&] { whole = header->magic == kMagic && header->version == kVersion && header->slots == kSlots; });
  return whole;
}

// The file's flock, and this handle's mutex first: threads of one process share the handle's open
// file description, whose flock does not keep them apart.
ShareTable::Exclusive::Exclusive(ShareTable& t) : table(t), threads(t.exclusive_mutex_) {
  const auto deadline = std::chrono::steady_clock::now() + table.lock_wait_;
  while (::flock(table.fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      throw ShareError("gpumem: sharing: cannot lock " + table.path_ + ": " + error_text());
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw ShareError("gpumem: sharing: another process has held " + table.path_ + "'s lock for more than " +
                       std::to_string(table.lock_wait_.count()) +
                       " ms (a process stopped while it made the table or granted a floor, or a `flock` on the "
                       "file); not sharing: end that process, or remove the file");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

ShareTable::Exclusive::~Exclusive() { ::flock(table.fd_, LOCK_UN); }

// ---- owners ----

std::uint32_t ShareTable::claim(std::uint32_t pid) {
  for (std::uint32_t i = 0; i < kSlots; ++i) {
    if (owned_by_this(i)) continue;
    struct flock lock = lock_of(i, F_WRLCK);
    if (::fcntl(fd_, F_OFD_SETLK, &lock) != 0) continue;  // its owner lives
    ShareSlot* s = slot(i);
    const bool written = guarded([&] {
      s->pid.store(0, std::memory_order_relaxed);  // whatever a dead owner left is stale
      s->uid.store(static_cast<std::uint32_t>(::geteuid()), std::memory_order_relaxed);
      s->pid_ns.store(pid_ns_, std::memory_order_relaxed);
      s->token.store(token_, std::memory_order_relaxed);
      s->floor.store(0, std::memory_order_relaxed);
      s->reserved.store(0, std::memory_order_relaxed);
      s->in_use.store(0, std::memory_order_relaxed);
      s->served.store(s->asks.load(std::memory_order_relaxed), std::memory_order_relaxed);
      s->wanted.store(0, std::memory_order_relaxed);
      s->asks_served.store(0, std::memory_order_relaxed);
      s->given_back.store(0, std::memory_order_relaxed);
      s->asks_made.store(0, std::memory_order_relaxed);
      s->pid.store(pid, std::memory_order_release);
    });
    if (!written) {
      struct flock unlock = lock_of(i, F_UNLCK);
      ::fcntl(fd_, F_OFD_SETLK, &unlock);
      return kSlots;
    }
    owned_.push_back({i, pid});
    return i;
  }
  return kSlots;
}

void ShareTable::release(std::uint32_t index) {
  if (index >= kSlots || !owned_by_this(index) || static_cast<int>(::getpid()) != opened_by_) return;
  ShareSlot* s = slot(index);
  guarded([&] {
    s->floor.store(0, std::memory_order_relaxed);
    s->pid.store(0, std::memory_order_release);
  });
  struct flock unlock = lock_of(index, F_UNLCK);
  ::fcntl(fd_, F_OFD_SETLK, &unlock);
  for (auto it = owned_.begin(); it != owned_.end(); ++it) {
    if (it->index == index) {
      owned_.erase(it);
      break;
    }
  }
}

bool ShareTable::owned_by_this(std::uint32_t index) const {
  for (const Owned& o : owned_) {
    if (o.index == index) return true;
  }
  return false;
}

bool ShareTable::owned_by_another(std::uint32_t index) const {
  struct flock lock = lock_of(index, F_WRLCK);
  if (::fcntl(fd_, F_OFD_GETLK, &lock) != 0) return false;
  return lock.l_type != F_UNLCK;
}

// ---- the owner's calls ----

bool ShareTable::publish(std::uint32_t index, const OwnFigures& figures) {
  std::uint32_t pid = 0;
  for (const Owned& o : owned_) {
    if (o.index == index) pid = o.pid;
  }
  if (pid == 0) return false;
  ShareSlot* s = slot(index);
  // The identity too, each round: another writer's change lasts one round at most.
  return guarded([&] {
    s->uid.store(static_cast<std::uint32_t>(::geteuid()), std::memory_order_relaxed);
    s->pid_ns.store(pid_ns_, std::memory_order_relaxed);
    s->token.store(token_, std::memory_order_relaxed);
    s->floor.store(figures.floor, std::memory_order_relaxed);
    s->reserved.store(figures.reserved, std::memory_order_relaxed);
    s->in_use.store(figures.in_use, std::memory_order_relaxed);
    s->pid.store(pid, std::memory_order_release);
  });
}

bool ShareTable::count(std::uint32_t index, std::uint64_t asks_served, std::uint64_t given_back,
                       std::uint64_t asks_made) {
  ShareSlot* s = slot(index);
  return guarded([&] {
    s->asks_served.store(asks_served, std::memory_order_relaxed);
    s->given_back.store(given_back, std::memory_order_relaxed);
    s->asks_made.store(asks_made, std::memory_order_relaxed);
  });
}

bool ShareTable::asks_of(std::uint32_t index, std::uint32_t& asks) {
  ShareSlot* s = slot(index);
  return guarded([&] { asks = s->asks.load(std::memory_order_acquire); });
}

bool ShareTable::take_wanted(std::uint32_t index, std::size_t& bytes) {
  ShareSlot* s = slot(index);
  return guarded([&] { bytes = s->wanted.exchange(0, std::memory_order_acq_rel); });
}

bool ShareTable::mark_served(std::uint32_t index, std::uint32_t asks) {
  ShareSlot* s = slot(index);
  return guarded([&] { s->served.store(asks, std::memory_order_release); });
}

// The futex calls are on a word of the shared mapping (not FUTEX_PRIVATE: other processes wake
// it). The kernel reads the word itself: a cut mapping makes the call fail (EFAULT), not fault.
void ShareTable::wait_for_ask(std::uint32_t index, std::uint32_t seen, std::chrono::milliseconds timeout) {
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000) * 1000000);
  const long rc = ::syscall(SYS_futex, futex_word(slot(index)->asks), FUTEX_WAIT, seen, &ts, nullptr, 0);
  if (rc != 0 && errno == EFAULT) std::this_thread::sleep_for(timeout);
}

void ShareTable::wake(std::uint32_t index) {
  ::syscall(SYS_futex, futex_word(slot(index)->asks), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// ---- the others ----

bool ShareTable::read_others(std::uint32_t except, std::size_t bound, std::vector<SlotCopy>& out) {
  out.clear();
  std::uint32_t pids[kSlots];
  if (!guarded([&] {
        for (std::uint32_t i = 0; i < kSlots; ++i) pids[i] = slots_[i].pid.load(std::memory_order_acquire);
      })) {
    return false;
  }
  for (std::uint32_t i = 0; i < kSlots; ++i) {
    if (i == except || pids[i] == 0 || owned_by_this(i) || !owned_by_another(i)) continue;
    SlotCopy copy;
    copy.index = i;
    ShareSlot* s = slot(i);
    std::uint64_t floor = 0, reserved = 0, in_use = 0, ns = 0;
    if (!guarded([&] {
          copy.pid = s->pid.load(std::memory_order_acquire);
          ns = s->pid_ns.load(std::memory_order_relaxed);
          floor = s->floor.load(std::memory_order_relaxed);
          reserved = s->reserved.load(std::memory_order_relaxed);
          in_use = s->in_use.load(std::memory_order_relaxed);
          copy.asks = s->asks.load(std::memory_order_relaxed);
          copy.served = s->served.load(std::memory_order_acquire);
        })) {
      return false;
    }
    if (copy.pid == 0) continue;  // released meanwhile
    copy.same_pid_namespace = ns == pid_ns_;
    copy.floor = bounded(floor, bound);
    copy.reserved = bounded(reserved, bound);
    copy.in_use = bounded(in_use, copy.reserved);
    out.push_back(copy);
  }
  return true;
}

bool ShareTable::read_counters(std::uint32_t index, OwnCounters& out) {
  ShareSlot* s = slot(index);
  return guarded([&] {
    out.asks_served = s->asks_served.load(std::memory_order_relaxed);
    out.given_back = s->given_back.load(std::memory_order_relaxed);
    out.asks_made = s->asks_made.load(std::memory_order_relaxed);
  });
}

bool ShareTable::ask(std::uint32_t index, std::size_t bytes, std::uint32_t& wanted) {
  ShareSlot* s = slot(index);
  const bool asked = guarded([&] {
    std::uint64_t was = s->wanted.load(std::memory_order_relaxed);
    while (!s->wanted.compare_exchange_weak(was, saturating_add(was, bytes), std::memory_order_acq_rel)) {
    }
    wanted = s->asks.fetch_add(1, std::memory_order_acq_rel) + 1;
  });
  if (!asked) return false;
  wake(index);
  return true;
}

bool ShareTable::served(std::uint32_t index, std::uint32_t& served) {
  ShareSlot* s = slot(index);
  return guarded([&] { served = s->served.load(std::memory_order_acquire); });
}

// ---- the file ----

std::string ShareTable::damaged() {
  struct stat now {};
  if (::fstat(fd_, &now) != 0) return "cannot be read: " + error_text();
  if (static_cast<std::size_t>(now.st_size) != bytes_) {
    return "was cut to " + std::to_string(now.st_size) + " bytes (a table has " + std::to_string(bytes_) + ")";
  }
  struct stat named {};
  if (::stat(path_.c_str(), &named) != 0) return "was removed";
  if (named.st_dev != identity_.st_dev || named.st_ino != identity_.st_ino) return "was replaced by another file";
  if (!header_whole()) return "has lost its header";
  const auto* header = static_cast<const ShareHeader*>(map_);
  std::uint64_t generation = 0;
  if (!guarded([&] { generation = header->generation; })) return "was cut";
  if (generation != generation_) return "was made afresh by another process";
  return "";
}

ShareLayout share_layout() {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
  return {kSlotsOffset,
          sizeof(ShareSlot),
          ShareTable::kSlots,
          {{"pid", offsetof(ShareSlot, pid)},
           {"uid", offsetof(ShareSlot, uid)},
           {"pid_ns", offsetof(ShareSlot, pid_ns)},
           {"token", offsetof(ShareSlot, token)},
           {"floor", offsetof(ShareSlot, floor)},
           {"reserved", offsetof(ShareSlot, reserved)},
           {"in_use", offsetof(ShareSlot, in_use)},
           {"asks", offsetof(ShareSlot, asks)},
           {"served", offsetof(ShareSlot, served)},
           {"wanted", offsetof(ShareSlot, wanted)},
           {"asks_served", offsetof(ShareSlot, asks_served)},
           {"given_back", offsetof(ShareSlot, given_back)},
           {"asks_made", offsetof(ShareSlot, asks_made)}}};
#pragma GCC diagnostic pop
}

}  // namespace gpumem
