// PiecePinning (backends/piece_pinning.h), the threads that pin a backup's new host memory ahead
// of its copies, with a pinning function of the test's: every piece pinned once, waited for in
// order, a failure reported and what was pinned known, and no thread left behind.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backends/piece_pinning.h"

using gpumem::PiecePinning;

namespace {

// Records which pieces were pinned, from which threads.
struct Recorder {
  std::mutex mutex;
  std::vector<int> times;  // per piece: how often it was pinned
  std::set<std::thread::id> threads;
  explicit Recorder(std::size_t pieces) : times(pieces, 0) {}
  int pin(std::size_t k) {
    std::lock_guard<std::mutex> lock(mutex);
    ++times[k];
    threads.insert(std::this_thread::get_id());
    return 0;
  }
};

}  // namespace

TEST_CASE("pinning threads pin every piece once and the caller waits for each in order", "[pinning][threads]") {
  const std::size_t pieces = 200;
  const unsigned threads = GENERATE(1u, 4u, 8u);
  Recorder recorder(pieces);
  {
    PiecePinning pinning(pieces, threads, [&](std::size_t k) { return recorder.pin(k); });
    for (std::size_t k = 0; k < pieces; ++k) {
      REQUIRE(pinning.wait_for(k) == 0);
      std::lock_guard<std::mutex> lock(recorder.mutex);
      REQUIRE(recorder.times[k] == 1);  // pinned by the time wait_for returns
    }
  }
  for (int times : recorder.times) REQUIRE(times == 1);
  REQUIRE(recorder.threads.count(std::this_thread::get_id()) == 0);  // the threads did it, not the caller
  REQUIRE(recorder.threads.size() <= threads);
}

TEST_CASE("with no thread the caller pins the pieces itself, in order, as it waits for them", "[pinning]") {
  Recorder recorder(5);
  PiecePinning pinning(5, 0, [&](std::size_t k) { return recorder.pin(k); });
  REQUIRE(pinning.wait_for(2) == 0);
  REQUIRE(recorder.times == std::vector<int>{1, 1, 1, 0, 0});
  REQUIRE(pinning.wait_for(4) == 0);
  REQUIRE(recorder.times == std::vector<int>{1, 1, 1, 1, 1});
  REQUIRE(recorder.threads == std::set<std::thread::id>{std::this_thread::get_id()});
}

TEST_CASE("a piece that cannot be pinned gives its reason, and after stop every piece is pinned or not for good",
          "[pinning][threads]") {
  const std::size_t pieces = 64;
  std::atomic<int> calls{0};
  PiecePinning pinning(pieces, 4, [&](std::size_t k) {
    ++calls;
    if (k == 10) return 2;  // the caller's error code
    if (k == 11) throw std::runtime_error("a pin that throws");
    return 0;
  });
  for (std::size_t k = 0; k < 10; ++k) REQUIRE(pinning.wait_for(k) == 0);
  REQUIRE(pinning.wait_for(10) == 2);
  REQUIRE(pinning.wait_for(11) == PiecePinning::kGivenUp);
  pinning.stop();
  const int pinned_calls = calls.load();
  std::size_t pinned = 0;
  for (std::size_t k = 0; k < pieces; ++k) {
    if (pinning.pinned(k)) ++pinned;
    if (k < 10) REQUIRE(pinning.pinned(k));
    if (k == 10 || k == 11) REQUIRE_FALSE(pinning.pinned(k));
    if (k > 11) REQUIRE(pinning.wait_for(k) == (pinning.pinned(k) ? 0 : PiecePinning::kGivenUp));
  }
  REQUIRE(static_cast<int>(pinned) == pinned_calls - 2);  // every pin that succeeded, and only those
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  REQUIRE(calls.load() == pinned_calls);  // stopped: nothing pins after
}

TEST_CASE("a pinning dropped before its pieces were waited for stops its threads", "[pinning][threads]") {
  std::atomic<int> calls{0};
  {
    PiecePinning pinning(10000, 8, [&](std::size_t) {
      ++calls;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return 0;
    });
    REQUIRE(pinning.wait_for(3) == 0);
  }
  const int after = calls.load();
  REQUIRE(after < 10000);  // the destructor stopped them long before the end
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  REQUIRE(calls.load() == after);
}
