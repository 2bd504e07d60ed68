// The settings gpumem is installed with, applied at first use (torch/startup.h): GPUMEM_LIMIT's text
// against the devices, GPUMEM_SEGMENTS, and what torch's allocator settings ask.
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>

#include <string>

#include "adapter_fixture.h"
#include "core/errors.h"
#include "core/limit_spec.h"
#include "torch/compat.h"
#include "torch/startup.h"
#if GPUMEM_TORCH_HAS_FRACTION_SETTING
#include <c10/core/AllocatorConfig.h>
#endif

using namespace gpumem;
using namespace gpumem::testing;

namespace {

void start(SimAdapter& sim, StartupSettings settings, TorchSettings torch = {}) {
  sim.adapter.core().defer_setup(
      [&sim, settings, torch](CachingAllocator&) { apply_startup(sim.adapter, settings, torch); });
}

std::string setup_error(SimAdapter& sim) {
  try {
    sim.adapter.core().run_setup();
  } catch (const LimitSpecError& error) {
    return error.what();
  }
  return "";
}

}  // namespace

TEST_CASE("setting_keys lists the keys of a settings string, lists in brackets kept whole", "[torch][startup]") {
  REQUIRE(setting_keys("") == std::set<std::string>{});
  REQUIRE(setting_keys("expandable_segments:True") == std::set<std::string>{"expandable_segments"});
  REQUIRE(setting_keys(" max_split_size_mb:200 , roundup_power2_divisions:[256:4,>:1],garbage_collection_threshold:0.6") ==
          std::set<std::string>{"max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold"});
}

TEST_CASE("GPUMEM_LIMIT's text applies to the devices when they are first used", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 2);
  start(sim, {std::string("0:1GB,1:25%"), std::nullopt, std::nullopt, std::nullopt});
  REQUIRE(sim.adapter.core().existing(0) == nullptr);
  REQUIRE(sim.core_device(1).limit() == 2 * GiB);
  REQUIRE(sim.core_device(0).limit() == 1 * GiB);
}

TEST_CASE("torch's init runs the setup, so a bad GPUMEM_LIMIT fails it with the variable named", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 2);
  start(sim, {std::string("0:9GB"), std::nullopt, std::nullopt, std::nullopt});
  try {
    sim.adapter.init(2);
    FAIL("init accepted a limit above the device");
  } catch (const c10::Error& error) {
    const std::string message = error.what_without_backtrace();
    REQUIRE(message.rfind("gpumem: bad GPUMEM_LIMIT \"0:9GB\": ", 0) == 0);
    REQUIRE(message.find("fix GPUMEM_LIMIT or unset it") != std::string::npos);
  }
  REQUIRE_FALSE(sim.adapter.initialized());
  REQUIRE(sim.adapter.core().existing(0) == nullptr);
  // Every later use fails the same way: nothing is handed out uncapped.
  REQUIRE_THROWS_AS(sim.adapter.allocate(1 * MiB), c10::Error);
  REQUIRE(sim.adapter.core().existing(0) == nullptr);
}

TEST_CASE("a GPUMEM_LIMIT naming a device that is not there is an error naming the devices", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 2);
  start(sim, {std::string("2:1GB"), std::nullopt, std::nullopt, std::nullopt});
  const std::string message = setup_error(sim);
  REQUIRE(message.rfind("gpumem: bad GPUMEM_LIMIT \"2:1GB\": there is no CUDA device 2; this process sees devices 0..1", 0) == 0);
}

TEST_CASE("a bad GPUMEM_LIMIT's error carries the whole value and the grammar's reason and forms alone", "[torch][startup]") {
  try {
    resolve_limit_text("0:4XB", {8 * GiB});
    FAIL("accepted");
  } catch (const LimitSpecError& error) {
    REQUIRE(error.setting() == "GPUMEM_LIMIT");
    REQUIRE(error.spec() == std::optional<std::string>("0:4XB"));
    REQUIRE(error.reason() == "unknown unit \"XB\"");
    REQUIRE(error.forms() == kLimitForms);
  }
}

TEST_CASE("a long bad GPUMEM_LIMIT is named short, once, with the reason", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 2);
  const std::string text = "0:9GB," + std::string(100'000, ' ');
  start(sim, {text, std::nullopt, std::nullopt, std::nullopt});
  const std::string message = setup_error(sim);
  REQUIRE(message.size() < 1000);
  REQUIRE(message.rfind("gpumem: bad GPUMEM_LIMIT \"0:9GB,", 0) == 0);
  REQUIRE_THAT(message, Catch::Contains("(100006 bytes in all): "));
  REQUIRE(message.find("bad limit") == std::string::npos);  // the grammar's own prefix is not repeated
}

TEST_CASE("a bad GPUMEM_LIMIT changes no device, even those it could apply to", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 2);
  start(sim, {std::string("0:1GB,1:9GB"), std::nullopt, std::nullopt, std::nullopt});
  REQUIRE_FALSE(setup_error(sim).empty());
  start(sim, {});
  REQUIRE(sim.core_device(0).limit() == 8 * GiB);
}

TEST_CASE("torch's per_process_memory_fraction caps each device, and the lower of two caps holds", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 2);
  TorchSettings torch;
  torch.fraction = 0.5;
  start(sim, {std::string("0:1GB,1:6GB"), std::nullopt, std::nullopt, std::nullopt}, torch);
  REQUIRE(sim.core_device(0).limit() == 1 * GiB);
  REQUIRE(sim.core_device(1).limit() == 4 * GiB);
}

TEST_CASE("a fraction of 0 leaves nothing to allocate, as native", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 1);
  TorchSettings torch;
  torch.fraction = 0.0;
  start(sim, {}, torch);
  REQUIRE(sim.core_device(0).limit() == 0);
  REQUIRE(sim.adapter.getMemoryFraction(0) == 0.0);
  REQUIRE_THROWS_AS(sim.adapter.allocate(1 * MiB), c10::OutOfMemoryError);
}

TEST_CASE("getMemoryFraction reads back torch's fraction, not the lower GPUMEM_LIMIT in force", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 2);
  TorchSettings torch;
  torch.fraction = 0.5;
  start(sim, {std::string("1GB"), std::nullopt, std::nullopt, std::nullopt}, torch);
  REQUIRE(sim.adapter.getMemoryFraction(1) == 0.5);
  REQUIRE(sim.core_device(1).limit() == 1 * GiB);
}

TEST_CASE("under GPUMEM_LIMIT alone getMemoryFraction is 1, as natively with no fraction set", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 1);
  start(sim, {std::string("2GB"), std::nullopt, std::nullopt, std::nullopt});
  REQUIRE(sim.adapter.getMemoryFraction(0) == 1.0);
  sim.adapter.setMemoryFraction(1.0, 0);
  REQUIRE(sim.adapter.getMemoryFraction(0) == 1.0);
  REQUIRE(sim.core_device(0).limit() == 8 * GiB);  // the last call holds
}

TEST_CASE("torch's expandable_segments picks the segments, and GPUMEM_SEGMENTS overrides it", "[torch][startup]") {
  TorchSettings torch;
  torch.growable = false;
  SimAdapter plain(8 * GiB, 1, 2 * MiB);
  start(plain, {}, torch);
  REQUIRE_FALSE(plain.core_device(0).settings().growable);
  SimAdapter growable(8 * GiB, 1, 2 * MiB);
  start(growable, {std::nullopt, true, std::nullopt, std::nullopt}, torch);
  REQUIRE(growable.core_device(0).settings().growable);
}

TEST_CASE("torch's garbage_collection_threshold becomes the release threshold", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 1);
  TorchSettings torch;
  torch.release_threshold = 0.6;
  start(sim, {std::string("2GB"), std::nullopt, std::nullopt, std::nullopt}, torch);
  REQUIRE(sim.core_device(0).settings().release_threshold == 0.6);
}

TEST_CASE("a limit set after the setup wins over it", "[torch][startup]") {
  SimAdapter sim(8 * GiB, 1);
  start(sim, {std::string("1GB"), std::nullopt, std::nullopt, std::nullopt});
  sim.core_device(0).set_limit(std::optional<std::size_t>(3 * GiB));
  REQUIRE(sim.core_device(0).limit() == 3 * GiB);
}

#if GPUMEM_TORCH_HAS_FRACTION_SETTING
namespace {

// torch's settings are process-wide: each test sets them and puts the defaults back.
struct TorchSettingsScope {
  explicit TorchSettingsScope(const std::string& text) { c10::CachingAllocator::setAllocatorSettings(text); }
  // A parse resets garbage_collection_threshold and max_split_size_mb unless it names them.
  ~TorchSettingsScope() {
    c10::CachingAllocator::setAllocatorSettings("expandable_segments:False,per_process_memory_fraction:1.0");
  }
};

}  // namespace

TEST_CASE("torch's settings, read as torch parsed them", "[torch][startup][settings]") {
  TorchSettingsScope scope("per_process_memory_fraction:0.25,garbage_collection_threshold:0.7,max_split_size_mb:64");
  const TorchSettings torch = read_torch_settings();
  REQUIRE(torch.fraction == 0.25);
  REQUIRE(torch.release_threshold == 0.7);
  REQUIRE_FALSE(torch.growable.has_value());  // not named: gpumem's default stands
  REQUIRE(torch.ignored == std::vector<std::string>{"max_split_size_mb"});
}

TEST_CASE("an invalid fraction fails with torch's own message", "[torch][startup][settings]") {
  REQUIRE_THROWS_WITH(c10::CachingAllocator::setAllocatorSettings("per_process_memory_fraction:1.5"),
                      Catch::Contains("per_process_memory_fraction is invalid"));
}

TEST_CASE("settings changed at run time reach the devices, except what gpumem's own settings fixed",
          "[torch][startup][settings]") {
  SimAdapter sim(8 * GiB, 2, 2 * MiB);
  start(sim, {});
  sim.core_device(0);  // device 0 exists, device 1 not yet
  {
    TorchSettingsScope scope("expandable_segments:False,garbage_collection_threshold:0.5");
    apply_changed_torch_settings(sim.adapter.core(), "expandable_segments:False,garbage_collection_threshold:0.5",
                                 false, true);
    REQUIRE_FALSE(sim.core_device(0).settings().growable);
    REQUIRE_FALSE(sim.core_device(1).settings().growable);
    REQUIRE(sim.core_device(0).settings().release_threshold == 0.0);  // set_release_threshold was called: it stays
  }
}

TEST_CASE("settings changed before the setup wait for it", "[torch][startup][settings]") {
  SimAdapter sim(8 * GiB, 1, 2 * MiB);
  start(sim, {});
  TorchSettingsScope scope("expandable_segments:False");
  apply_changed_torch_settings(sim.adapter.core(), "expandable_segments:False", false, false);
  REQUIRE(sim.adapter.core().setup_pending());
  sim.adapter.core().defer_setup(startup_setup(sim.adapter, {}));  // the real setup, which reads torch's settings
  REQUIRE_FALSE(sim.core_device(0).settings().growable);
}
#endif
