// The device allocator's lock: a mutex whose uncontended lock and unlock are one atomic operation
// each, inline, where std::mutex goes through pthread_mutex_lock and _unlock (about 50
// instructions a pair, an eighth of a cached malloc+free). Contended, a thread spins briefly and
// then sleeps in the kernel (futex), as pthread's mutex does; it is not recursive and not fair.
//
// state_: 0 free, 1 held, 2 held and a thread may be asleep waiting for it (the three-state mutex
// of Drepper, "Futexes Are Tricky"). Acquire on lock and release on unlock order the guarded data
// as std::mutex does. Linux only, as the rest of gpumem.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace gpumem {

class Lock {
 public:
  Lock() = default;
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

  void lock() {
    int expected = 0;
    if (!state_.compare_exchange_strong(expected, 1, std::memory_order_acquire, std::memory_order_relaxed)) {
      lock_contended(expected);
    }
  }
  bool try_lock() {
    int expected = 0;
    return state_.compare_exchange_strong(expected, 1, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void unlock() {
    if (state_.exchange(0, std::memory_order_release) == 2) wake_one();
  }

 private:
  static constexpr int kSpins = 128;

  void lock_contended(int seen) {
    for (int i = 0; i < kSpins && seen == 1; ++i) {
      pause();
      seen = state_.load(std::memory_order_relaxed);
      if (seen == 0) {
        if (state_.compare_exchange_strong(seen, 1, std::memory_order_acquire, std::memory_order_relaxed)) return;
      }
    }
    // Mark a waiter, and sleep while someone else holds it.
    while (state_.exchange(2, std::memory_order_acquire) != 0) {
      syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAIT_PRIVATE, 2, nullptr, nullptr, 0);
    }
  }
  void wake_one() { syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0); }
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  std::atomic<int> state_{0};
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the atomic itself");
};

}  // namespace gpumem
