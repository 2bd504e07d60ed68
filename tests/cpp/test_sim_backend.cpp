// The simulated device's model of virtual memory: address ranges that cost nothing, pages mapped
// into them that count as memory in use, refusals through the same fault injection as plain
// segments, peer access, and a logic_error wherever a caller breaks core/backend.h's contract.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "backends/sim_backend.h"
#include "core/errors.h"

namespace {

using gpumem::CaptureMarker;
using gpumem::MemInfo;
using gpumem::SimBackend;
using gpumem::StreamId;

constexpr StreamId kStream0 = 0, kStream1 = 1, kStream2 = 2;

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t kPage = 2 * MiB;
constexpr std::size_t kCapacity = 64 * MiB;

// A one-device backend with virtual memory on and 2 MiB pages.
struct VmSim {
  SimBackend backend;
  explicit VmSim(std::size_t capacity = kCapacity, int devices = 1) : backend(capacity, devices) {
    backend.enable_virtual_memory(kPage);
  }
  void* reserve_address(std::size_t bytes, int device = 0) { return backend.reserve_address(device, bytes); }
  SimBackend::Ledger ledger(int device = 0) const { return backend.ledger(device); }
};

std::uintptr_t at(void* ptr, std::size_t offset = 0) { return reinterpret_cast<std::uintptr_t>(ptr) + offset; }
void* ptr_at(void* ptr, std::size_t offset) { return static_cast<char*>(ptr) + offset; }

bool overlap(std::uintptr_t a, std::size_t a_bytes, std::uintptr_t b, std::size_t b_bytes) {
  return a < b + b_bytes && b < a + a_bytes;
}

}  // namespace

// ---- Turning it on ----------------------------------------------------------------------------

TEST_CASE("a simulated device has no virtual memory by default", "[sim]") {
  SimBackend backend(kCapacity, 2);
  REQUIRE(backend.page_size(0) == 0);
  REQUIRE(backend.page_size(1) == 0);
  REQUIRE(backend.reserve_address(0, kPage) == nullptr);
}

TEST_CASE("enable_virtual_memory sets the page size of every device", "[sim]") {
  SimBackend backend(kCapacity, 2);
  backend.enable_virtual_memory(kPage);
  REQUIRE(backend.page_size(0) == kPage);
  REQUIRE(backend.page_size(1) == kPage);
}

TEST_CASE("enable_virtual_memory accepts a 512-byte page", "[sim]") {
  SimBackend backend(kCapacity);
  backend.enable_virtual_memory(512);
  REQUIRE(backend.page_size(0) == 512);
}

TEST_CASE("enable_virtual_memory rejects a page that is not a power of two of at least 512 bytes", "[sim]") {
  SimBackend backend(kCapacity);
  REQUIRE_THROWS_AS(backend.enable_virtual_memory(0), std::invalid_argument);
  REQUIRE_THROWS_AS(backend.enable_virtual_memory(256), std::invalid_argument);
  REQUIRE_THROWS_AS(backend.enable_virtual_memory(3 * MiB), std::invalid_argument);
  REQUIRE(backend.page_size(0) == 0);
}

TEST_CASE("the page size cannot change while an address range is reserved", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(kPage);
  REQUIRE_THROWS_AS(sim.backend.enable_virtual_memory(4 * MiB), std::logic_error);
  sim.backend.release_address(0, range, kPage);
  sim.backend.enable_virtual_memory(4 * MiB);
  REQUIRE(at(sim.reserve_address(4 * MiB)) % (4 * MiB) == 0);
}

// ---- Address ranges ---------------------------------------------------------------------------

TEST_CASE("reserve_address hands out page-aligned ranges", "[sim]") {
  VmSim sim;
  for (std::size_t pages : {1, 3, 1, 7}) REQUIRE(at(sim.reserve_address(pages * kPage)) % kPage == 0);
}

TEST_CASE("live address ranges do not overlap each other", "[sim]") {
  VmSim sim;
  void* a = sim.reserve_address(3 * kPage);
  void* b = sim.reserve_address(kPage);
  void* c = sim.reserve_address(5 * kPage);
  REQUIRE_FALSE(overlap(at(a), 3 * kPage, at(b), kPage));
  REQUIRE_FALSE(overlap(at(a), 3 * kPage, at(c), 5 * kPage));
  REQUIRE_FALSE(overlap(at(b), kPage, at(c), 5 * kPage));
}

TEST_CASE("address ranges do not overlap plain segments", "[sim]") {
  VmSim sim(8 * GiB, 2);
  void* segment = sim.backend.reserve(0, 4 * GiB);
  void* other_device_segment = sim.backend.reserve(1, 4 * GiB);
  void* range = sim.reserve_address(8 * GiB);
  REQUIRE_FALSE(overlap(at(range), 8 * GiB, at(segment), 4 * GiB));
  REQUIRE_FALSE(overlap(at(range), 8 * GiB, at(other_device_segment), 4 * GiB));
}

TEST_CASE("an address range may be as large as the device and costs no memory", "[sim]") {
  VmSim sim(80 * GiB);
  REQUIRE(sim.reserve_address(80 * GiB) != nullptr);
  REQUIRE(sim.ledger().address_ranges == 1);
  REQUIRE(sim.ledger().in_use == 0);
  REQUIRE(sim.backend.mem_info(0).free == 80 * GiB);
}

TEST_CASE("address ranges refuse once their region is used up, rather than wrap around", "[sim]") {
  // The region for a device of 1 GiB is 16 TiB: three ranges of 6 TiB do not fit.
  VmSim sim(GiB, 2);
  const std::size_t bytes = std::size_t{6} << 40;
  void* a = sim.reserve_address(bytes);
  void* b = sim.reserve_address(bytes);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  REQUIRE(sim.reserve_address(bytes) == nullptr);
  void* other = sim.reserve_address(bytes, 1);  // the other device's region is its own
  REQUIRE(other != nullptr);
  for (void* range : {a, b}) REQUIRE_FALSE(overlap(at(range), bytes, at(other), bytes));
  sim.backend.release_address(0, a, bytes);
  REQUIRE(sim.reserve_address(bytes) == a);
}

TEST_CASE("the largest device maps pages anywhere in a range as large as it", "[sim]") {
  VmSim sim(SimBackend::kMaxCapacity);
  void* range = sim.reserve_address(SimBackend::kMaxCapacity);
  REQUIRE(range != nullptr);
  const std::size_t last = SimBackend::kMaxCapacity - kPage;
  REQUIRE(sim.backend.map(0, range, 3 * kPage, kPage));
  REQUIRE(sim.backend.map(0, ptr_at(range, last), kPage, kPage));
  REQUIRE(sim.backend.map(0, ptr_at(range, 3 * kPage), 3 * kPage, kPage));  // joins the first run
  sim.backend.unmap(0, ptr_at(range, kPage), 4 * kPage);  // splits the runs either side
  REQUIRE(sim.backend.is_mapped(0, at(range)));
  REQUIRE_FALSE(sim.backend.is_mapped(0, at(range, kPage)));
  REQUIRE_FALSE(sim.backend.is_mapped(0, at(range, 4 * kPage)));
  REQUIRE(sim.backend.is_mapped(0, at(range, 5 * kPage)));
  REQUIRE(sim.backend.is_mapped(0, at(range, last)));
  REQUIRE(sim.ledger().mapped == 3 * kPage);
  REQUIRE_THROWS_AS(sim.backend.map(0, ptr_at(range, 5 * kPage), kPage, kPage), std::logic_error);
  REQUIRE(sim.backend.map(0, ptr_at(range, kPage), 4 * kPage, 2 * kPage));  // joins them into one run
  sim.backend.unmap(0, range, 6 * kPage);
  sim.backend.unmap(0, ptr_at(range, last), kPage);
  REQUIRE(sim.ledger().mapped == 0);
  sim.backend.release_address(0, range, SimBackend::kMaxCapacity);
}

TEST_CASE("an unmap gives back whole allocations of map calls only", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(8 * kPage);
  REQUIRE(sim.backend.map(0, range, 5 * kPage, 2 * kPage));  // allocations of 2, 2 and 1 pages
  REQUIRE(sim.ledger().allocations == 3);
  REQUIRE_THROWS_AS(sim.backend.unmap(0, range, kPage), std::logic_error);
  REQUIRE_THROWS_AS(sim.backend.unmap(0, ptr_at(range, kPage), 2 * kPage), std::logic_error);
  REQUIRE_THROWS_AS(sim.backend.unmap(0, range, 3 * kPage), std::logic_error);
  REQUIRE(sim.ledger().mapped == 5 * kPage);  // the refusals changed nothing
  sim.backend.unmap(0, ptr_at(range, 2 * kPage), 3 * kPage);
  sim.backend.unmap(0, range, 2 * kPage);
  REQUIRE(sim.ledger().mapped == 0);
  REQUIRE_THROWS_AS(sim.backend.map(0, range, 2 * kPage, kPage / 2), std::logic_error);
  sim.backend.release_address(0, range, 8 * kPage);
}

TEST_CASE("a device larger than the simulator models is refused, naming the sizes", "[sim]") {
  try {
    SimBackend backend(SimBackend::kMaxCapacity + 1);
    FAIL("no error");
  } catch (const std::invalid_argument& e) {
    REQUIRE_THAT(e.what(), Catch::Contains(std::to_string(SimBackend::kMaxCapacity + 1)) &&
                               Catch::Contains(std::to_string(SimBackend::kMaxCapacity)));
  }
  REQUIRE_THROWS_AS(SimBackend(GiB, 0), std::invalid_argument);
  REQUIRE_THROWS_AS(SimBackend(GiB, SimBackend::kMaxDevices + 1), std::invalid_argument);
  REQUIRE_THROWS_WITH(SimBackend(SimBackend::kMaxCapacity, SimBackend::kMaxDevices),
                      Catch::Contains("do not fit in a 64-bit address space"));
}

TEST_CASE("the most devices cost only what is used, and their addresses stay apart", "[sim]") {
  VmSim sim(8 * GiB, SimBackend::kMaxDevices);
  const int last = SimBackend::kMaxDevices - 1;
  void* first_segment = sim.backend.reserve(0, GiB);
  void* last_segment = sim.backend.reserve(last, GiB);
  void* last_range = sim.reserve_address(8 * GiB, last);
  REQUIRE_FALSE(overlap(at(first_segment), GiB, at(last_segment), GiB));
  REQUIRE_FALSE(overlap(at(last_range), 8 * GiB, at(last_segment), GiB));
  REQUIRE(at(last_range) + 8 * GiB > at(last_range));
  REQUIRE(sim.ledger(last).in_use == GiB);
  REQUIRE_THROWS_AS(sim.backend.reserve(last + 1, GiB), gpumem::DeviceError);
}

TEST_CASE("release_address ends a range", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(2 * kPage);
  sim.backend.release_address(0, range, 2 * kPage);
  REQUIRE(sim.ledger().address_ranges == 0);
  REQUIRE_THROWS_AS(sim.backend.map(0, range, kPage, kPage), std::logic_error);
}

TEST_CASE("refuse_addresses makes reserve_address return nullptr until it is cleared", "[sim]") {
  VmSim sim;
  sim.backend.refuse_addresses(true);
  REQUIRE(sim.reserve_address(kPage) == nullptr);
  REQUIRE(sim.ledger().address_ranges == 0);
  sim.backend.refuse_addresses(false);
  REQUIRE(sim.reserve_address(kPage) != nullptr);
}

// ---- Mapping ----------------------------------------------------------------------------------

TEST_CASE("map counts the mapped bytes as memory in use", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(8 * kPage);
  REQUIRE(sim.backend.map(0, range, 3 * kPage, kPage));
  const SimBackend::Ledger ledger = sim.ledger();
  REQUIRE(ledger.in_use == 3 * kPage);
  REQUIRE(ledger.mapped == 3 * kPage);
  REQUIRE(ledger.peak == 3 * kPage);
  REQUIRE(ledger.maps == 1);
}

TEST_CASE("map marks exactly its pages mapped", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE(sim.backend.map(0, ptr_at(range, kPage), 2 * kPage, kPage));
  REQUIRE_FALSE(sim.backend.is_mapped(0, at(range)));
  REQUIRE(sim.backend.is_mapped(0, at(range, kPage)));
  REQUIRE(sim.backend.is_mapped(0, at(range, 3 * kPage - 1)));
  REQUIRE_FALSE(sim.backend.is_mapped(0, at(range, 3 * kPage)));
}

TEST_CASE("the peak covers plain segments and mapped pages together", "[sim]") {
  VmSim sim;
  void* segment = sim.backend.reserve(0, 10 * MiB);
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE(sim.backend.map(0, range, 4 * kPage, kPage));
  sim.backend.release(0, segment, 10 * MiB);
  REQUIRE(sim.ledger().peak == 10 * MiB + 4 * kPage);
  REQUIRE(sim.ledger().in_use == 4 * kPage);
}

TEST_CASE("map is refused beyond the capacity and leaves nothing mapped", "[sim]") {
  VmSim sim;
  REQUIRE(sim.backend.reserve(0, kCapacity - 2 * kPage) != nullptr);
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE_FALSE(sim.backend.map(0, range, 3 * kPage, kPage));
  REQUIRE(sim.ledger().refusals == 1);
  REQUIRE(sim.ledger().mapped == 0);
  REQUIRE(sim.ledger().maps == 0);
  REQUIRE(sim.ledger().in_use == kCapacity - 2 * kPage);
  REQUIRE_FALSE(sim.backend.is_mapped(0, at(range)));
  REQUIRE(sim.backend.map(0, range, 2 * kPage, kPage));
}

TEST_CASE("map is refused by fail_next", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(2 * kPage);
  sim.backend.fail_next(1);
  REQUIRE_FALSE(sim.backend.map(0, range, kPage, kPage));
  REQUIRE(sim.ledger().refusals == 1);
  REQUIRE_FALSE(sim.backend.is_mapped(0, at(range)));
  REQUIRE(sim.backend.map(0, range, kPage, kPage));
}

TEST_CASE("map is refused by fail_when, which sees the bytes to map", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  sim.backend.fail_when([](int, std::size_t bytes) { return bytes > kPage; });
  REQUIRE_FALSE(sim.backend.map(0, range, 2 * kPage, kPage));
  REQUIRE(sim.backend.map(0, range, kPage, kPage));
}

TEST_CASE("unmap returns the bytes to the device", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE(sim.backend.map(0, range, 4 * kPage, kPage));
  sim.backend.unmap(0, range, 4 * kPage);
  const SimBackend::Ledger ledger = sim.ledger();
  REQUIRE(ledger.in_use == 0);
  REQUIRE(ledger.mapped == 0);
  REQUIRE(ledger.peak == 4 * kPage);
  REQUIRE(ledger.unmaps == 1);
  REQUIRE_FALSE(sim.backend.is_mapped(0, at(range)));
}

TEST_CASE("one unmap may return pages of several map calls", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE(sim.backend.map(0, range, kPage, kPage));
  REQUIRE(sim.backend.map(0, ptr_at(range, kPage), 3 * kPage, kPage));
  sim.backend.unmap(0, range, 4 * kPage);
  REQUIRE(sim.ledger().mapped == 0);
}

TEST_CASE("unmap may return part of what one map call mapped", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE(sim.backend.map(0, range, 4 * kPage, kPage));
  sim.backend.unmap(0, ptr_at(range, 2 * kPage), 2 * kPage);
  REQUIRE(sim.ledger().mapped == 2 * kPage);
  REQUIRE(sim.backend.is_mapped(0, at(range, kPage)));
  REQUIRE_FALSE(sim.backend.is_mapped(0, at(range, 2 * kPage)));
}

TEST_CASE("mem_info's free memory falls by the mapped bytes", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE(sim.backend.map(0, range, 3 * kPage, kPage));
  const MemInfo info = sim.backend.mem_info(0);
  REQUIRE(info.total == kCapacity);
  REQUIRE(info.free == kCapacity - 3 * kPage);
}

// ---- Misuse -----------------------------------------------------------------------------------

TEST_CASE("mapping a page that is already mapped is a logic error", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE(sim.backend.map(0, ptr_at(range, kPage), kPage, kPage));
  REQUIRE_THROWS_AS(sim.backend.map(0, range, 2 * kPage, kPage), std::logic_error);
  REQUIRE(sim.ledger().mapped == kPage);
}

TEST_CASE("unmapping a page that is not mapped is a logic error", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE(sim.backend.map(0, range, kPage, kPage));
  REQUIRE_THROWS_AS(sim.backend.unmap(0, range, 2 * kPage), std::logic_error);
  REQUIRE(sim.ledger().mapped == kPage);
}

TEST_CASE("an unaligned map or unmap is a logic error", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE_THROWS_AS(sim.backend.map(0, ptr_at(range, 512), kPage, kPage), std::logic_error);
  REQUIRE_THROWS_AS(sim.backend.map(0, range, kPage + 512, kPage), std::logic_error);
  REQUIRE_THROWS_AS(sim.backend.map(0, range, 0, kPage), std::logic_error);
  REQUIRE(sim.backend.map(0, range, kPage, kPage));
  REQUIRE_THROWS_AS(sim.backend.unmap(0, range, kPage / 2), std::logic_error);
}

TEST_CASE("mapping outside a reserved range is a logic error", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(2 * kPage);
  REQUIRE_THROWS_AS(sim.backend.map(0, range, 3 * kPage, kPage), std::logic_error);
  REQUIRE_THROWS_AS(sim.backend.map(0, ptr_at(range, 2 * kPage), kPage, kPage), std::logic_error);
  REQUIRE_THROWS_AS(sim.backend.map(0, ptr_at(range, -static_cast<std::ptrdiff_t>(kPage)), kPage, kPage),
                    std::logic_error);
}

TEST_CASE("mapping without virtual memory is a logic error", "[sim]") {
  SimBackend backend(kCapacity);
  void* segment = backend.reserve(0, kPage);
  REQUIRE_THROWS_AS(backend.map(0, segment, kPage, kPage), std::logic_error);
}

TEST_CASE("releasing a range with pages mapped is a logic error", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE(sim.backend.map(0, ptr_at(range, 3 * kPage), kPage, kPage));
  REQUIRE_THROWS_AS(sim.backend.release_address(0, range, 4 * kPage), std::logic_error);
  REQUIRE(sim.ledger().address_ranges == 1);
}

TEST_CASE("releasing a range that was not reserved with that size is a logic error", "[sim]") {
  VmSim sim;
  void* range = sim.reserve_address(4 * kPage);
  REQUIRE_THROWS_AS(sim.backend.release_address(0, range, 2 * kPage), std::logic_error);
  REQUIRE_THROWS_AS(sim.backend.release_address(0, ptr_at(range, kPage), 3 * kPage), std::logic_error);
}

TEST_CASE("reserving a range that is not a multiple of the page is a logic error", "[sim]") {
  VmSim sim;
  REQUIRE_THROWS_AS(sim.reserve_address(kPage + 512), std::logic_error);
  REQUIRE_THROWS_AS(sim.reserve_address(0), std::logic_error);
}

// ---- Peers ------------------------------------------------------------------------------------

TEST_CASE("a granted peer can access pages mapped before the grant", "[sim]") {
  VmSim sim(kCapacity, 2);
  void* range = sim.reserve_address(2 * kPage);
  REQUIRE(sim.backend.map(0, range, kPage, kPage));
  sim.backend.grant_peer(0, 1);
  REQUIRE(sim.backend.peer_can_access(0, 1, at(range)));
}

TEST_CASE("a granted peer can access pages mapped after the grant", "[sim]") {
  VmSim sim(kCapacity, 2);
  void* range = sim.reserve_address(2 * kPage);
  sim.backend.grant_peer(0, 1);
  REQUIRE(sim.backend.map(0, ptr_at(range, kPage), kPage, kPage));
  REQUIRE(sim.backend.peer_can_access(0, 1, at(range, kPage)));
}

TEST_CASE("a peer that was not granted cannot access mapped pages", "[sim]") {
  VmSim sim(kCapacity, 3);
  void* range = sim.reserve_address(kPage);
  REQUIRE(sim.backend.map(0, range, kPage, kPage));
  sim.backend.grant_peer(0, 2);
  REQUIRE_FALSE(sim.backend.peer_can_access(0, 1, at(range)));
}

TEST_CASE("a granted peer cannot access pages that are not mapped", "[sim]") {
  VmSim sim(kCapacity, 2);
  void* range = sim.reserve_address(2 * kPage);
  sim.backend.grant_peer(0, 1);
  REQUIRE(sim.backend.map(0, range, kPage, kPage));
  REQUIRE_FALSE(sim.backend.peer_can_access(0, 1, at(range, kPage)));
  sim.backend.unmap(0, range, kPage);
  REQUIRE_FALSE(sim.backend.peer_can_access(0, 1, at(range)));
}

TEST_CASE("a stream follows a capture marker once it has waited for the marked stream", "[sim][capture]") {
  SimBackend sim(1 * GiB);
  const CaptureMarker marker = sim.capture_marker(0, kStream1);
  REQUIRE(marker != 0);
  REQUIRE(sim.capture_follows(0, kStream1, marker));  // a stream follows its own work
  REQUIRE_FALSE(sim.capture_follows(0, kStream0, marker));
  sim.wait_stream(0, kStream0, kStream1);
  REQUIRE(sim.capture_follows(0, kStream0, marker));
}

TEST_CASE("waiting for a stream before the mark does not follow it", "[sim][capture]") {
  SimBackend sim(1 * GiB);
  sim.wait_stream(0, kStream0, kStream1);
  const CaptureMarker marker = sim.capture_marker(0, kStream1);
  REQUIRE_FALSE(sim.capture_follows(0, kStream0, marker));
}

TEST_CASE("following a marker passes through streams that joined it", "[sim][capture]") {
  SimBackend sim(1 * GiB);
  const CaptureMarker marker = sim.capture_marker(0, kStream2);
  sim.wait_stream(0, kStream1, kStream2);
  REQUIRE_FALSE(sim.capture_follows(0, kStream0, marker));
  sim.wait_stream(0, kStream0, kStream1);
  REQUIRE(sim.capture_follows(0, kStream0, marker));
}

TEST_CASE("a backend that cannot read the capture makes no markers", "[sim][capture]") {
  SimBackend sim(1 * GiB);
  sim.refuse_capture_markers(true);
  REQUIRE(sim.capture_marker(0, kStream1) == 0);
}
