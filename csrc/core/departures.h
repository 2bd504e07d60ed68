// Plain segments on their way back to the device: empty_cache takes them out of the tables under
// the whole device, and gives them to the backend (cudaFree) after letting go of it, so that a
// long cudaFree (a 100 GiB segment takes tens of milliseconds or more) stalls no other thread: the
// cached paths and the whole device are free meanwhile. Until a segment is back, the cap still
// counts its bytes, so reserved never passes the limit, not by one byte. A request that needs
// those bytes waits for them, with no lock held, and tries again (DeviceCore::malloc).
//
// `bytes` changes only under the whole device (add when segments leave the tables, done when the
// backend has them), so the checker reads it with the cap and the statistics:
//   cap.reserved == reserved_bytes statistic + uncached bytes + departures' bytes.
// Waiting takes only this type's own mutex.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>

namespace gpumem {

class SegmentSource;

// One segment taken out of the tables and not yet given back.
struct Departure {
  SegmentSource* source = nullptr;
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

class Departures {
 public:
  std::size_t bytes() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return bytes_;
  }
  void add(std::size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    bytes_ += bytes;
  }
  void done(std::size_t bytes) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      bytes_ -= bytes;
    }
    gone_.notify_all();
  }
  // Waits, holding no allocator lock, until nothing is departing; false at once if nothing was.
  bool wait() const {
    std::unique_lock<std::mutex> lock(mutex_);
    if (bytes_ == 0) return false;
    gone_.wait(lock, [this] { return bytes_ == 0; });
    return true;
  }

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable gone_;
  std::size_t bytes_ = 0;
};

}  // namespace gpumem
