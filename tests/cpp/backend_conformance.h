// What every backend must do, as core/backend.h specifies it: one suite, run for each backend.
//
// A file that includes this header first names its backends as a tuple of fixtures,
//   using ConformanceBackends = std::tuple<SimPlainFixture, SimPagedFixture>;
// each with `Backend& backend`, `std::string name`, and what the backend is expected to have:
// `bool has_virtual_memory` (page_size > 0) and `bool has_process_accounting` (process_used). The simulated device's run is part of the
// core tests (tests/cpp/test_backend_conformance.cpp, in CI); the CUDA backend's is its own binary
// (tests/cuda/test_cuda_conformance.cpp), run on a GPU machine by tools/gpu_check.sh.
#pragma once

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "core/backend.h"

namespace gpumem_conformance {

using gpumem::Backend;
using gpumem::MemInfo;

constexpr std::size_t kMiB = std::size_t{1} << 20;

inline std::uintptr_t at(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

}  // namespace gpumem_conformance

TEMPLATE_LIST_TEST_CASE("a backend counts its devices and says each one's total and free memory",
                        "[conformance]", ConformanceBackends) {
  using namespace gpumem_conformance;
  TestType f;
  Backend& b = f.backend;
  REQUIRE(b.device_count() >= 1);
  const MemInfo info = b.mem_info(0);
  REQUIRE(info.total > 0);
  REQUIRE(info.free <= info.total);
  REQUIRE(b.total_memory(0) == info.total);
}

TEMPLATE_LIST_TEST_CASE("reserve hands out distinct segments of the bytes asked, and release takes them back",
                        "[conformance]", ConformanceBackends) {
  using namespace gpumem_conformance;
  TestType f;
  Backend& b = f.backend;
  const std::size_t free_before = b.mem_info(0).free;
  std::vector<std::pair<void*, std::size_t>> segments;
  for (std::size_t bytes : {2 * kMiB, 2 * kMiB, 4 * kMiB}) {
    void* p = b.reserve(0, bytes);
    REQUIRE(p != nullptr);
    REQUIRE(at(p) % 512 == 0);  // blocks are multiples of 512 from a segment's start
    for (const auto& [q, q_bytes] : segments) REQUIRE((at(p) + bytes <= at(q) || at(q) + q_bytes <= at(p)));
    segments.emplace_back(p, bytes);
  }
  for (const auto& [p, bytes] : segments) b.release(0, p, bytes);
  // The memory went back to the device (a driver's figure may move by a few MiB of its own).
  REQUIRE(b.mem_info(0).free + 8 * kMiB >= free_before);
  void* again = b.reserve(0, 4 * kMiB);
  REQUIRE(again != nullptr);
  b.release(0, again, 4 * kMiB);
}

TEMPLATE_LIST_TEST_CASE("a request larger than the device is refused with nullptr, and the backend goes on",
                        "[conformance]", ConformanceBackends) {
  using namespace gpumem_conformance;
  TestType f;
  Backend& b = f.backend;
  const std::size_t total = b.total_memory(0);
  REQUIRE(b.reserve(0, total + 64 * kMiB) == nullptr);
  void* p = b.reserve(0, 2 * kMiB);
  REQUIRE(p != nullptr);
  b.release(0, p, 2 * kMiB);
}

TEMPLATE_LIST_TEST_CASE("an event recorded on a stream is done once the stream's work is waited for; a device it lacks is refused",
                        "[conformance]", ConformanceBackends) {
  using namespace gpumem_conformance;
  TestType f;
  Backend& b = f.backend;
  gpumem::EventId event = b.record_event(0, 0);
  REQUIRE(event != nullptr);
  b.synchronize_stream(0, 0);
  REQUIRE(b.event_done(0, event));
  b.destroy_event(0, event);
  gpumem::EventId second = b.record_event(0, 0);
  b.synchronize(0);
  REQUIRE(b.event_done(0, second));
  b.destroy_event(0, second);
  // A device the backend does not have: an error, never a read past its tables.
  REQUIRE_THROWS(b.record_event(b.device_count(), 0));
}

TEMPLATE_LIST_TEST_CASE("process_used, where a backend has it, counts the memory it handed out, and never throws",
                        "[conformance]", ConformanceBackends) {
  using namespace gpumem_conformance;
  TestType f;
  Backend& b = f.backend;
  REQUIRE_FALSE(b.process_used(b.device_count()).has_value());  // no such device: nothing, not an error
  const std::optional<std::size_t> before = b.process_used(0);
  void* p = b.reserve(0, 64 * kMiB);
  REQUIRE(p != nullptr);
  const std::optional<std::size_t> after = b.process_used(0);
  b.release(0, p, 64 * kMiB);
  REQUIRE(before.has_value() == after.has_value());
  if (after) {
    INFO(f.name << ": " << *before << " bytes before, " << *after << " after");
    REQUIRE(*after >= *before + 64 * kMiB);
  }
  REQUIRE(f.has_process_accounting == after.has_value());
}

TEMPLATE_LIST_TEST_CASE("virtual memory, where a backend has it: aligned ranges, pages mapped and unmapped",
                        "[conformance]", ConformanceBackends) {
  using namespace gpumem_conformance;
  TestType f;
  Backend& b = f.backend;
  const std::size_t page = b.page_size(0);
  REQUIRE(f.has_virtual_memory == (page > 0));
  if (page == 0) {
    REQUIRE(b.reserve_address(0, 2 * kMiB) == nullptr);  // the defaults of a backend without it
    return;
  }
  REQUIRE((page & (page - 1)) == 0);
  void* range = b.reserve_address(0, 4 * page);
  REQUIRE(range != nullptr);
  REQUIRE(at(range) % page == 0);
  const MemInfo empty = b.mem_info(0);
  REQUIRE(b.map(0, range, 2 * page, page));  // two allocations of a page each
  const MemInfo two = b.mem_info(0);
  REQUIRE(two.free + 2 * page <= empty.free + page);  // the pages are device memory now (driver slack: a page)
  REQUIRE(b.map(0, static_cast<char*>(range) + 2 * page, 2 * page, 2 * page));  // one of two pages
  b.unmap(0, range, page);                 // one allocation of a mapped stretch
  // Part of an allocation is refused and changes nothing; the whole of it then goes.
  REQUIRE_THROWS_AS(b.unmap(0, static_cast<char*>(range) + page, 2 * page), std::logic_error);
  b.unmap(0, static_cast<char*>(range) + page, 3 * page);
  REQUIRE(b.mem_info(0).free + page >= empty.free);  // unmapped pages are the device's again
  // More pages than the device has: refused, nothing stays mapped, and a smaller map then works.
  const std::size_t total = b.total_memory(0);
  const std::size_t too_many = (total / page + 2) * page;
  void* huge = b.reserve_address(0, too_many);
  if (!huge) WARN(f.name << ": no address range of " << too_many << " bytes; the oversized map went unchecked");
  if (huge) {
    REQUIRE_FALSE(b.map(0, huge, too_many, page));
    REQUIRE_FALSE(b.map(0, huge, too_many, too_many));
    REQUIRE(b.map(0, huge, page, page));
    b.unmap(0, huge, page);
    b.release_address(0, huge, too_many);
  }
  b.release_address(0, range, 4 * page);
}
