// The adapter's allocation path as torch drives it: allocate() DataPtrs, raw pointers, streams,
// out-of-memory, and the small lifecycle calls.
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "adapter_fixture.h"
#include "torch_settings.h"

using namespace gpumem;
using namespace gpumem::testing;

namespace {

// Every figure of the statistics, in flatten()'s order without its names. flatten() itself returns
// std::strings, which gpumem_core (built with the default libstdc++ ABI) and a test against a torch
// of the old ABI (2.6's wheels) spell differently, so the test would not link there.
std::vector<std::int64_t> figures(const DeviceStats& stats) {
  std::vector<std::int64_t> out;
#define GPUMEM_FIGURES_OF_ARRAY(name, help) \
  for (const Stat& s : stats.name) out.insert(out.end(), {s.current, s.peak, s.allocated, s.freed});
  GPUMEM_STAT_ARRAYS(GPUMEM_FIGURES_OF_ARRAY)
#undef GPUMEM_FIGURES_OF_ARRAY
#define GPUMEM_FIGURE_OF_COUNTER(name, help) out.push_back(stats.name);
  GPUMEM_STAT_COUNTERS(GPUMEM_FIGURE_OF_COUNTER)
#undef GPUMEM_FIGURE_OF_COUNTER
  return out;
}

}  // namespace

TEST_CASE("allocate returns memory of the current device whose context is the gpumem block", "[torch][allocate]") {
  SimAdapter sim;
  sim.context.device = 1;
  c10::DataPtr ptr = sim.adapter.allocate(1000);
  REQUIRE(ptr.get() != nullptr);
  REQUIRE(ptr.device() == c10::Device(c10::DeviceType::CUDA, 1));
  const auto* block = static_cast<const Block*>(ptr.get_context());
  REQUIRE(block->ptr() == ptr.get());
  REQUIRE(block->allocated);
  REQUIRE(block->requested == 1000);
  REQUIRE(block->segment->owner->device() == 1);
}

TEST_CASE("allocate serves the current stream", "[torch][allocate]") {
  SimAdapter sim;
  sim.context.stream = 42;
  c10::DataPtr ptr = sim.adapter.allocate(4 * MiB);
  REQUIRE(static_cast<const Block*>(ptr.get_context())->stream == 42);
}

TEST_CASE("freeing the DataPtr returns the block to the cache", "[torch][allocate]") {
  SimAdapter sim;
  {
    c10::DataPtr ptr = sim.adapter.allocate(4 * MiB);
    REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 4 * MiB);
  }
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 0);
  REQUIRE(sim.reserved() > 0);
  sim.core_device().check_invariants();
}

TEST_CASE("a freed block is reused by the next request of its size", "[torch][allocate]") {
  SimAdapter sim;
  std::uintptr_t first = 0;
  {
    c10::DataPtr ptr = sim.adapter.allocate(3 * MiB);
    first = address_of(ptr);
  }
  c10::DataPtr again = sim.adapter.allocate(3 * MiB);
  REQUIRE(address_of(again) == first);
}

TEST_CASE("allocate of zero bytes gives an empty DataPtr on the current device and allocates nothing", "[torch][allocate]") {
  SimAdapter sim;
  sim.context.device = 1;
  c10::DataPtr ptr = sim.adapter.allocate(0);
  REQUIRE(ptr.get() == nullptr);
  REQUIRE(ptr.device() == c10::Device(c10::DeviceType::CUDA, 1));
  REQUIRE(TorchAllocator::owns(ptr));
  REQUIRE(sim.adapter.core().existing(1) == nullptr);
}

TEST_CASE("raw_deleter is the deleter of every DataPtr allocate makes", "[torch][allocate]") {
  SimAdapter sim;
  c10::DataPtr ptr = sim.adapter.allocate(100);
  REQUIRE(ptr.get_deleter() == sim.adapter.raw_deleter());
}

TEST_CASE("a gpumem DataPtr counts as a simple data pointer", "[torch][allocate]") {
  SimAdapter sim;
  c10::DataPtr ptr = sim.adapter.allocate(100);
  REQUIRE(sim.adapter.is_simple_data_ptr(ptr));
}

TEST_CASE("raw_alloc and raw_delete allocate and free by address", "[torch][raw]") {
  SimAdapter sim;
  void* ptr = sim.adapter.raw_alloc(5 * MiB);
  REQUIRE(ptr != nullptr);
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 5 * MiB);
  sim.adapter.raw_delete(ptr);
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == 0);
}

TEST_CASE("raw_alloc_with_stream serves the given stream on the current device", "[torch][raw]") {
  SimAdapter sim;
  sim.context.device = 1;
  void* ptr = sim.adapter.raw_alloc_with_stream(1000, reinterpret_cast<cudaStream_t>(9));
  const Block* block = sim.adapter.core().find_raw(ptr);
  REQUIRE(block->stream == 9);
  REQUIRE(block->segment->owner->device() == 1);
  sim.adapter.raw_delete(ptr);
}

TEST_CASE("raw_alloc of zero bytes returns null and raw_delete of null does nothing", "[torch][raw]") {
  SimAdapter sim;
  REQUIRE(sim.adapter.raw_alloc(0) == nullptr);
  sim.adapter.raw_delete(nullptr);
}

TEST_CASE("raw_delete of an address gpumem did not hand out is a c10 error naming it", "[torch][raw]") {
  SimAdapter sim;
  int not_device_memory = 0;
  REQUIRE_THROWS_WITH(sim.adapter.raw_delete(&not_device_memory), Catch::Contains("gpumem: raw_delete of"));
}

TEST_CASE("recordStream keeps a freed block from reuse until the stream's work is done", "[torch][streams]") {
  SimAdapter sim;
  std::uintptr_t first = 0;
  {
    c10::DataPtr ptr = sim.adapter.allocate(4 * MiB);
    first = address_of(ptr);
    sim.adapter.record_stream(ptr, 7);
  }
  {
    c10::DataPtr busy = sim.adapter.allocate(4 * MiB);
    REQUIRE(address_of(busy) != first);
  }
  sim.backend.complete_events();
  c10::DataPtr again = sim.adapter.allocate(4 * MiB);
  REQUIRE(address_of(again) == first);
}

TEST_CASE("recordStream takes torch's CUDAStream", "[torch][streams]") {
  SimAdapter sim;
  c10::DataPtr ptr = sim.adapter.allocate(4 * MiB);
  const auto stream = c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(0x7000), 0);
  const auto* block = static_cast<const Block*>(ptr.get_context());
  // From torch 2.15 CUDAStream::stream() sets up CUDA's streams first, which needs a driver: on a
  // machine without one torch raises, and the adapter must then record nothing.
  bool torch_resolves_streams = true;
  try {
    (void)stream.stream();
  } catch (const c10::Error&) {
    torch_resolves_streams = false;
  }
  if (torch_resolves_streams) {
    sim.adapter.recordStream(ptr, stream);
    REQUIRE(block->stream_uses == std::vector<StreamId>{0x7000});
  } else {
    REQUIRE_THROWS_AS(sim.adapter.recordStream(ptr, stream), c10::Error);
    REQUIRE(block->stream_uses.empty());
  }
}

TEST_CASE("recordStream on a DataPtr gpumem did not make, or an empty one, records no stream use anywhere",
          "[torch][streams]") {
  SimAdapter sim;
  c10::DataPtr mine = sim.adapter.allocate(4 * MiB);
  const auto* block = static_cast<const Block*>(mine.get_context());
  c10::DataPtr empty = sim.adapter.allocate(0);
  const auto before = figures(sim.core_device().stats());
  int other_memory = 0;
  c10::DataPtr foreign(&other_memory, c10::Device(c10::DeviceType::CUDA, 0));
  sim.adapter.record_stream(foreign, 7);
  sim.adapter.record_stream(empty, 7);
  REQUIRE(block->stream_uses.empty());
  REQUIRE(figures(sim.core_device().stats()) == before);
  // Freed, gpumem's block waits for no stream: no event was recorded for it.
  mine.clear();
  REQUIRE(sim.backend.ledger(0).live_events == 0);
  REQUIRE(sim.core_device().stats().active_bytes[kAll].current == 0);
}

TEST_CASE("out of memory throws c10::OutOfMemoryError with gpumem's message", "[torch][oom]") {
  SimAdapter sim;
  sim.core_device().set_limit(std::string_view("256MB"));
  try {
    (void)sim.adapter.allocate(300 * MiB);
    FAIL("no error");
  } catch (const c10::OutOfMemoryError& e) {
    const std::string message = e.what_without_backtrace();
    REQUIRE_THAT(message, Catch::StartsWith("CUDA out of memory. Tried to allocate 300.00 MiB. GPU 0 has a total "
                                            "capacity of 1024.00 MiB of which 1024.00 MiB is free. 256.00 MiB allowed; "
                                            "Of the allocated memory 0 bytes is allocated by PyTorch"));
    REQUIRE_THAT(message, Catch::Contains("gpumem: over the limit, under a limit of 256.00 MiB"));
  }
}

TEST_CASE("out of memory counts in num_ooms and the allocator keeps working", "[torch][oom]") {
  SimAdapter sim;
  sim.core_device().set_limit(std::string_view("256MB"));
  REQUIRE_THROWS_AS(sim.adapter.allocate(300 * MiB), c10::OutOfMemoryError);
  REQUIRE(sim.adapter.getDeviceStats(0).num_ooms == 1);
  c10::DataPtr ptr = sim.adapter.allocate(200 * MiB);
  REQUIRE(ptr.get() != nullptr);
  sim.core_device().check_invariants();
}

TEST_CASE("out of memory calls the attached observers with device and size and total and free", "[torch][oom]") {
  SimAdapter sim(1 * GiB);
  sim.core_device().set_limit(std::string_view("256MB"));
  std::vector<std::tuple<int64_t, size_t, size_t, size_t>> calls;
  sim.adapter.attachOutOfMemoryObserver([&](int64_t device, size_t size, size_t total, size_t free) {
    calls.emplace_back(device, size, total, free);
  });
  REQUIRE_THROWS_AS(sim.adapter.allocate(300 * MiB), c10::OutOfMemoryError);
  REQUIRE(calls.size() == 1);
  REQUIRE(calls[0] == std::make_tuple(int64_t{0}, 300 * MiB, 1 * GiB, 1 * GiB));
}

TEST_CASE("raw_alloc out of memory throws c10::OutOfMemoryError too", "[torch][oom]") {
  SimAdapter sim;
  sim.core_device().set_limit(std::string_view("256MB"));
  REQUIRE_THROWS_AS(sim.adapter.raw_alloc(300 * MiB), c10::OutOfMemoryError);
}

TEST_CASE("a device the backend does not have is a c10::ValueError naming it", "[torch][allocate]") {
  SimAdapter sim;
  sim.context.device = 5;
  REQUIRE_THROWS_AS(sim.adapter.allocate(100), c10::ValueError);
  REQUIRE_THROWS_WITH(sim.adapter.allocate(100), Catch::Contains("device 5 does not exist"));
}

TEST_CASE("init is idempotent and makes initialized true", "[torch][lifecycle]") {
  SimAdapter sim;
  REQUIRE_FALSE(sim.adapter.initialized());
  sim.adapter.init(2);
  sim.adapter.init(2);
  REQUIRE(sim.adapter.initialized());
}

TEST_CASE("name is native, so that torch's settings may say backend:native", "[torch][lifecycle]") {
  SimAdapter sim;
  REQUIRE(sim.adapter.name() == "native");
}

#if GPUMEM_TORCH_HAS_EXPANDABLE_SEGMENT_SIZES  // getExpandableSegmentSizes: from 2.10 on
TEST_CASE("a device with plain segments lists no expandable segments", "[torch][lifecycle]") {
  SimAdapter sim;
  sim.context.stream = 7;
  c10::DataPtr a = sim.adapter.allocate(8 * MiB);
  REQUIRE(sim.adapter.getExpandableSegmentSizes(0).empty());
}
#endif

TEST_CASE("torch's roundup_power2_divisions setting rounds blocks as native does", "[torch][allocate]") {
  set_torch_settings("roundup_power2_divisions:4");
  SimAdapter sim(4 * GiB);
  c10::DataPtr rounded = sim.adapter.allocate(84 * MiB);
  const auto stats = sim.core_device().stats();
  REQUIRE(stats.allocated_bytes[kAll].current == 96 * MiB);
  REQUIRE(stats.requested_bytes[kAll].current == 84 * MiB);
  set_torch_settings("");  // each parse resets the divisions
  c10::DataPtr plain = sim.adapter.allocate(84 * MiB);
  REQUIRE(sim.core_device().stats().allocated_bytes[kAll].current == (96 + 84) * MiB);
}

TEST_CASE("the divisions gpumem reads for a size are torch's own, in every band, under every setting", "[torch][allocate]") {
  const std::string setting = GENERATE(as<std::string>{}, "", "roundup_power2_divisions:4",
                                       "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]",
                                       "roundup_power2_divisions:[1:2,2:4,4:8,8:16,16:32,32:2,>:64]");
  INFO("setting '" << setting << "'");
  set_torch_settings(setting);
  std::vector<std::size_t> sizes;
  for (int k = 0; k < 64; ++k) {
    const std::size_t p = std::size_t{1} << k;
    sizes.insert(sizes.end(), {p, p - 1, p + 1, p + p / 2});
  }
  std::size_t differing_bands = 0;  // the settings must not all read alike, or the test shows nothing
  for (const std::size_t size : sizes) {
    if (size == 0) continue;
    INFO("size " << size);
    const std::size_t torch = torch_divisions(size);
    REQUIRE(torch_compat::divisions_of(size) == torch);
    differing_bands += torch > 1 ? 1 : 0;
  }
  REQUIRE((setting.empty() ? differing_bands == 0 : differing_bands > 0));
  set_torch_settings("");
}
