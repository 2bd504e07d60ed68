// Pieces of new host memory pinned by a few threads, in order, while the caller waits for each in
// turn and copies into those pinned already (the CUDA backend's backups of paused regions:
// backends/cuda_backups.cpp). Pinning new memory runs far below the copies, so the threads keep
// ahead of them. The pinning itself is a function given, so that the
// threading is tested without a GPU (tests/cpp/test_piece_pinning.cpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace gpumem {

class PiecePinning {
 public:
  // Pins piece k: 0 where it did, else the reason (a positive error code of the caller's). It
  // must not throw; a throw counts as kGivenUp.
  using Pin = std::function<int(std::size_t piece)>;
  static constexpr int kGivenUp = -1;  // not pinned: stop() came first, or the pin threw
  static constexpr int kPending = -2;  // not yet claimed, or being pinned

  // Starts up to `threads` threads (no more than there are pieces) that pin the pieces in order.
  // Where none can start, wait_for pins the pieces itself, in order.
  PiecePinning(std::size_t pieces, unsigned threads, Pin pin)
      : pin_(std::move(pin)), status_(pieces, kPending) {
    const std::size_t wanted = std::min<std::size_t>(threads, pieces);
    try {
      for (std::size_t t = 0; t < wanted; ++t) threads_.emplace_back([this] { while (run_one()) {} });
    } catch (const std::system_error&) {
      // Fewer threads than asked (none: wait_for pins).
    }
  }
  ~PiecePinning() { stop(); }
  PiecePinning(const PiecePinning&) = delete;
  PiecePinning& operator=(const PiecePinning&) = delete;

  // Waits until piece k is pinned or failed: 0, or why not.
  int wait_for(std::size_t k) {
    if (threads_.empty()) {
      while (!done(k) && run_one()) {}
    }
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] { return status_[k] != kPending; });
    return status_[k];
  }

  // No piece is pinned from now on: waits for the threads; a piece not pinned by then is kGivenUp.
  void stop() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    std::lock_guard<std::mutex> lock(mutex_);
    for (int& status : status_) {
      if (status == kPending) status = kGivenUp;
    }
    finished_.notify_all();
  }

  // After stop(): whether piece k was pinned (the caller unpins it).
  bool pinned(std::size_t k) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return status_[k] == 0;
  }

 private:
  bool done(std::size_t k) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return status_[k] != kPending;
  }

  // Claims the next piece and pins it; false when none is left.
  bool run_one() {
    const std::size_t k = next_.fetch_add(1);
    if (k >= status_.size()) return false;
    int status = kGivenUp;
    if (!stop_) {
      try {
        status = pin_(k);
      } catch (...) {
        status = kGivenUp;
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    status_[k] = status;
    finished_.notify_all();
    return true;
  }

  const Pin pin_;
  std::vector<int> status_;  // per piece: 0, the pin's error, kGivenUp or kPending; guarded by mutex_
  std::atomic<std::size_t> next_{0};
  std::atomic<bool> stop_{false};
  mutable std::mutex mutex_;
  std::condition_variable finished_;
  std::vector<std::thread> threads_;
};

}  // namespace gpumem
