// The shared table's file: trust checks, creation, the slots' life (claim, release, stale).
#include "core/share_table.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

namespace gpumem {

namespace {

constexpr std::uint64_t kMagic = 0x31726168736d7067ull;  // "gpmshar1"
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kSlotsOffset = 128;  // the header, padded to a slot's alignment

std::size_t table_bytes() { return kSlotsOffset + sizeof(ShareSlot) * ShareTable::kSlots; }

std::string octal(unsigned mode) {
  char text[16];
  std::snprintf(text, sizeof text, "%04o", mode & 07777u);
  return text;
}

std::string dir_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Holds an flock for the table's creation only.
class FileLock {
 public:
  explicit FileLock(int fd) : fd_(fd) { locked_ = ::flock(fd_, LOCK_EX) == 0; }
  ~FileLock() {
    if (locked_) ::flock(fd_, LOCK_UN);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
  bool locked_;
};

}  // namespace

std::string share_file_problem(const struct stat& info, unsigned uid) {
  if (!S_ISREG(info.st_mode)) return "is not a regular file";
  if (info.st_uid != uid) return "belongs to uid " + std::to_string(info.st_uid) + ", not to this user (uid " +
                                 std::to_string(uid) + ")";
  if (info.st_mode & 077) return "has mode " + octal(info.st_mode) + "; it must be 0600";
  return "";
}

std::string share_dir_problem(const struct stat& info, unsigned uid) {
  if (!S_ISDIR(info.st_mode)) return "is not a directory";
  if (info.st_uid != uid) return "belongs to uid " + std::to_string(info.st_uid) + ", not to this user (uid " +
                                 std::to_string(uid) + ")";
  if (info.st_mode & (S_IWGRP | S_IWOTH)) return "has mode " + octal(info.st_mode) + ": writable by others";
  return "";
}

ShareTable::ShareTable(const std::string& path) : path_(path), liveness_(process_alive) {
  const unsigned uid = ::geteuid();
  struct stat dir {};
  const std::string where = dir_of(path);
  if (::stat(where.c_str(), &dir) != 0) throw ShareError("gpumem: sharing: cannot read " + where + ": " + std::strerror(errno));
  if (std::string why = share_dir_problem(dir, uid); !why.empty()) {
    throw ShareError("gpumem: sharing: directory " + where + " " + why + "; not sharing");
  }
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd_ < 0) throw ShareError("gpumem: sharing: cannot open " + path + ": " + std::strerror(errno));
  try {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) throw ShareError("gpumem: sharing: cannot read " + path + ": " + std::strerror(errno));
    if (std::string why = share_file_problem(info, uid); !why.empty()) {
      throw ShareError("gpumem: sharing: " + path + " " + why + "; not sharing");
    }
    bytes_ = table_bytes();
    const FileLock lock(fd_);
    if (::fstat(fd_, &info) != 0) throw ShareError("gpumem: sharing: cannot read " + path);
    const bool fresh = info.st_size == 0;
    if (fresh && ::ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) {
      throw ShareError("gpumem: sharing: cannot size " + path + ": " + std::strerror(errno));
    }
    if (!fresh && static_cast<std::size_t>(info.st_size) != bytes_) {
      throw ShareError("gpumem: sharing: " + path + " has " + std::to_string(info.st_size) + " bytes, not the " +
                       std::to_string(bytes_) + " of this gpumem's table; remove it");
    }
    map_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      throw ShareError("gpumem: sharing: cannot map " + path + ": " + std::strerror(errno));
    }
    auto* header = static_cast<ShareHeader*>(map_);
    if (fresh) {
      header->version = kVersion;
      header->slots = kSlots;
      header->magic = kMagic;  // zero-filled slots are free slots
    } else if (header->magic != kMagic || header->version != kVersion || header->slots != kSlots) {
      throw ShareError("gpumem: sharing: " + path + " is not a table of this gpumem version; remove it");
    }
    slots_ = reinterpret_cast<ShareSlot*>(static_cast<char*>(map_) + kSlotsOffset);
  } catch (...) {
    if (map_) ::munmap(map_, bytes_);
    ::close(fd_);
    throw;
  }
}

ShareTable::~ShareTable() {
  if (map_) ::munmap(map_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

// Whoever turns the pid from the stale one to kBusy owns the reset; a claimer takes only pid 0.
bool ShareTable::drop_if_stale(ShareSlot& s, std::uint32_t pid) {
  if (liveness_(pid, s.start_time.load(std::memory_order_acquire))) return false;
  std::uint32_t expected = pid;
  if (!s.pid.compare_exchange_strong(expected, kBusy, std::memory_order_acq_rel)) return true;
  s.floor.store(0, std::memory_order_relaxed);
  s.reserved.store(0, std::memory_order_relaxed);
  s.in_use.store(0, std::memory_order_relaxed);
  s.pid.store(0, std::memory_order_release);
  return true;
}

std::uint32_t ShareTable::claim(std::uint32_t pid, std::uint64_t start_time, std::uint32_t uid) {
  for (std::uint32_t i = 0; i < kSlots; ++i) {
    ShareSlot& s = slots_[i];
    std::uint32_t seen = s.pid.load(std::memory_order_acquire);
    if (seen != 0 && seen != kBusy) drop_if_stale(s, seen);
    std::uint32_t expected = 0;
    if (!s.pid.compare_exchange_strong(expected, kBusy, std::memory_order_acq_rel)) continue;
    s.uid.store(uid, std::memory_order_relaxed);
    s.start_time.store(start_time, std::memory_order_relaxed);
    s.floor.store(0, std::memory_order_relaxed);
    s.reserved.store(0, std::memory_order_relaxed);
    s.in_use.store(0, std::memory_order_relaxed);
    s.served.store(s.asks.load(std::memory_order_relaxed), std::memory_order_relaxed);
    s.asks_served.store(0, std::memory_order_relaxed);
    s.given_back.store(0, std::memory_order_relaxed);
    s.asks_made.store(0, std::memory_order_relaxed);
    s.pid.store(pid, std::memory_order_release);
    return i;
  }
  return kSlots;
}

void ShareTable::release(std::uint32_t index) {
  if (index >= kSlots) return;
  ShareSlot& s = slots_[index];
  s.floor.store(0, std::memory_order_relaxed);
  s.pid.store(0, std::memory_order_release);
}

void ShareTable::for_each_live(std::uint32_t except, const std::function<void(std::uint32_t, ShareSlot&)>& visit) {
  for (std::uint32_t i = 0; i < kSlots; ++i) {
    if (i == except) continue;
    ShareSlot& s = slots_[i];
    const std::uint32_t pid = s.pid.load(std::memory_order_acquire);
    if (pid == 0 || pid == kBusy || drop_if_stale(s, pid)) continue;
    visit(i, s);
  }
}

std::uint64_t process_start_time(std::uint32_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%u/stat", pid);
  std::FILE* f = std::fopen(path, "re");
  if (!f) return 0;
  char text[1024];
  const std::size_t n = std::fread(text, 1, sizeof text - 1, f);
  std::fclose(f);
  text[n] = '\0';
  // The command name may hold spaces and parentheses: fields count from the last ')'.
  const char* p = std::strrchr(text, ')');
  if (!p) return 0;
  if (p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X')) return 0;  // a zombie holds no memory any more
  int field = 2;
  for (; *p && field < 22; ++p) {
    if (*p == ' ') ++field;
  }
  return std::strtoull(p, nullptr, 10);
}

bool process_alive(std::uint32_t pid, std::uint64_t start_time) {
  if (pid == 0 || pid > 0x3fffffffu) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  const std::uint64_t now = process_start_time(pid);
  if (now == 0) return false;  // gone, or a zombie's stat vanished
  return start_time == 0 || now == start_time;
}

}  // namespace gpumem
