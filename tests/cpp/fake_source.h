// A pool's own segment source for the tests, as a MemPool's allocator would be: it hands out
// addresses nothing can dereference from a region no simulated device uses, keeps its own ledger
// (the witness that segments come from it and go back to it, each exactly once), and can be told
// to refuse (nullptr: "no memory") or to throw (a broken allocator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

#include "core/segment_source.h"

namespace gpumem_test {

struct SourceError : std::runtime_error {
  SourceError() : std::runtime_error("the pool's allocator broke") {}
};

class FakeSource final : public gpumem::SegmentSource {
 public:
  // Far above the simulated devices' plain segments ((device + 1) << 44) for any device a test uses.
  static constexpr std::uintptr_t kBase = std::uintptr_t{7} << 52;

  explicit FakeSource(std::size_t capacity = std::size_t{1} << 40) : capacity_(capacity) {}

  void* reserve(std::size_t bytes) override {
    ++reserve_calls;
    if (throw_next > 0) {
      --throw_next;
      throw SourceError();
    }
    if (refuse_next > 0 || bytes > capacity_ - in_use) {
      if (refuse_next > 0) --refuse_next;
      ++refusals;
      return nullptr;
    }
    const std::uintptr_t addr = next_;
    next_ += (bytes + 0xFFFFF) & ~std::uintptr_t{0xFFFFF};  // 1 MiB apart: no two segments touch
    live_.emplace(addr, bytes);
    in_use += bytes;
    if (in_use > peak) peak = in_use;
    ++reserves;
    return reinterpret_cast<void*>(addr);
  }

  void release(void* ptr, std::size_t bytes) override {
    const auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == live_.end() || it->second != bytes) {
      throw std::logic_error("FakeSource: release of " + std::to_string(bytes) + " bytes it did not hand out");
    }
    live_.erase(it);
    in_use -= bytes;
    ++releases;
  }

  bool owns(std::uintptr_t addr) const {
    auto it = live_.upper_bound(addr);
    if (it == live_.begin()) return false;
    --it;
    return addr < it->first + it->second;
  }

  int refuse_next = 0;
  int throw_next = 0;
  std::size_t in_use = 0;
  std::size_t peak = 0;
  std::uint64_t reserve_calls = 0;  // every call, refused or thrown included
  std::uint64_t reserves = 0;       // successful ones
  std::uint64_t releases = 0;
  std::uint64_t refusals = 0;

 private:
  std::size_t capacity_;
  std::uintptr_t next_ = kBase;
  std::map<std::uintptr_t, std::size_t> live_;
};

}  // namespace gpumem_test
