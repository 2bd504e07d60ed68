#include "torch/startup.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>

#include "core/errors.h"
#include "core/limit_spec.h"
#include "torch/allocator.h"
#include "torch/compat.h"
#if GPUMEM_TORCH_HAS_FRACTION_SETTING
#include <c10/cuda/CUDAAllocatorConfig.h>
#endif

namespace gpumem {

namespace {

constexpr std::string_view kLimitVariable = "GPUMEM_LIMIT";

std::string_view trimmed(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\n\r");
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(" \t\n\r") - first + 1);
}

// GPUMEM_LIMIT's whole value is the spec the message names: a per-device spec alone would not say
// which variable to fix. The grammar's reason and forms are taken as they are (core/errors.h).
[[noreturn]] void bad_limit(const std::string& text, const std::string& reason, const std::string& forms = "") {
  throw LimitSpecError({std::string(kLimitVariable), text, reason, forms,
                        "No CUDA memory is handed out until it is fixed: fix " + std::string(kLimitVariable) +
                            " or unset it, and start the program again."});
}

std::optional<std::size_t> lower(std::optional<std::size_t> a, std::optional<std::size_t> b) {
  if (!a) return b;
  if (!b) return a;
  return std::min(*a, *b);
}

const char* settings_name() {
  if (std::getenv("PYTORCH_CUDA_ALLOC_CONF")) return "PYTORCH_CUDA_ALLOC_CONF";
  if (std::getenv("PYTORCH_ALLOC_CONF")) return "PYTORCH_ALLOC_CONF";
  return "torch's allocator settings";
}

void warn_ignored(const std::vector<std::string>& ignored) {
  if (ignored.empty()) return;
  std::string names;
  for (const std::string& name : ignored) names += (names.empty() ? "" : ", ") + name;
  TORCH_WARN("gpumem: ", settings_name(), " sets ", names,
             ", which gpumem ignores: its blocks are split and rounded by its own rules, and its growable segments "
             "leave no cached block too large to reuse. gpumem.set_limit, gpumem.set_segments and "
             "gpumem.set_release_threshold are what it takes.");
}

}  // namespace

std::vector<std::optional<std::size_t>> resolve_limit_text(const std::string& text,
                                                           const std::vector<std::size_t>& totals) {
  // The grammar's errors, reworded to name GPUMEM_LIMIT and its whole value.
  const auto naming_the_variable = [&](auto&& f) {
    try {
      return f();
    } catch (const LimitSpecError& error) {
      bad_limit(text, error.reason(), error.forms());
    }
  };
  const int count = static_cast<int>(totals.size());
  std::vector<std::optional<std::size_t>> out(totals.size());
  for (const LimitAssignment& a : naming_the_variable([&] { return parse_limit_assignments(text); })) {
    if (a.device >= count) {
      const std::string visible = count ? "devices 0.." + std::to_string(count - 1) : "no device";
      bad_limit(text, "there is no CUDA device " + std::to_string(a.device) + "; this process sees " + visible +
                          " (CUDA_VISIBLE_DEVICES applies)");
    }
    const int first = a.device < 0 ? 0 : a.device, last = a.device < 0 ? count : a.device + 1;
    for (int d = first; d < last; ++d) out[d] = naming_the_variable([&] { return parse_limit(a.spec, totals[d]); });
  }
  return out;
}

std::set<std::string> setting_keys(std::string_view text) {
  std::set<std::string> keys;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    const char c = i < text.size() ? text[i] : ',';
    if (c == '[') ++depth;
    if (c == ']' && depth > 0) --depth;
    if (c != ',' || depth > 0) continue;
    const std::string_view item = text.substr(start, i - start);
    const std::string_view key = trimmed(item.substr(0, item.find(':')));
    if (!key.empty()) keys.emplace(key);
    start = i + 1;
  }
  return keys;
}

TorchSettings read_torch_settings(std::optional<std::string_view> text) {
  TorchSettings settings;
#if GPUMEM_TORCH_HAS_FRACTION_SETTING
  using Config = c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig;
  using Generic = c10::CachingAllocator::AcceleratorAllocatorConfig;
  settings.fraction = Config::per_process_memory_fraction();  // parses; throws torch's error if bad
  const std::set<std::string> keys = setting_keys(text ? std::string(*text) : Generic::last_allocator_settings());
  // Not Config::expandable_segments(): inline, it answers false in any build that, as gpumem's,
  // lacks torch's PYTORCH_C10_DRIVER_API_SUPPORTED. gpumem maps pages itself, where the driver can.
  if (keys.count("expandable_segments")) settings.growable = Generic::use_expandable_segments();
  if (keys.count("garbage_collection_threshold") && Generic::garbage_collection_threshold() > 0) {
    settings.release_threshold = Generic::garbage_collection_threshold();
  }
  for (const char* key : {"max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb"}) {
    if (keys.count(key)) settings.ignored.emplace_back(key);
  }
  if (keys.count("release_lock_on_cudamalloc") && Config::release_lock_on_cudamalloc()) {
    settings.ignored.emplace_back("release_lock_on_cudamalloc");
  }
#else
  (void)text;
#endif
  return settings;
}

void apply_startup(TorchAllocator& adapter, const StartupSettings& settings, const TorchSettings& torch) {
  CachingAllocator& core = adapter.core();
  const int count = core.device_count();
  std::vector<std::size_t> totals;
  for (int d = 0; d < count; ++d) totals.push_back(core.backend().total_memory(d));
  const auto limits = settings.limits ? resolve_limit_text(*settings.limits, totals)
                                      : std::vector<std::optional<std::size_t>>(count);
  std::vector<AllocatorConfig> configs;
  for (int d = 0; d < count; ++d) {
    AllocatorConfig config = core.config(d);
    if (torch.fraction < 1.0) {
      config.limit = lower(config.limit, static_cast<std::size_t>(torch.fraction * static_cast<double>(totals[d])));
    }
    config.limit = lower(config.limit, limits[d]);
    if (torch.growable) config.growable = *torch.growable;
    if (settings.growable) config.growable = *settings.growable;
    if (settings.scope) config.scope = *settings.scope;
    if (settings.chunk) config.large_chunk = *settings.chunk;
    if (torch.release_threshold) config.release_threshold = *torch.release_threshold;
    configs.push_back(config);
  }
  for (int d = 0; d < count; ++d) core.configure(d, configs[d]);
  adapter.set_startup_fraction(torch.fraction);
  warn_ignored(torch.ignored);
}

void apply_changed_torch_settings(CachingAllocator& core, std::string_view text, bool keep_segments,
                                  bool keep_threshold) {
  if (core.setup_pending()) return;
  TorchSettings torch = read_torch_settings(text);
  if (keep_segments) torch.growable.reset();
  if (keep_threshold) torch.release_threshold.reset();
  for (int d = 0; d < core.device_count(); ++d) {
    if (!torch.growable && !torch.release_threshold) break;
    AllocatorConfig config = core.config(d);
    if (torch.growable) config.growable = *torch.growable;
    if (torch.release_threshold) config.release_threshold = *torch.release_threshold;
    if (DeviceAllocator* device = core.existing(d)) {  // its config is what it was made with
      if (torch.growable) device->set_growable(*torch.growable);
      if (torch.release_threshold) device->set_release_threshold(*torch.release_threshold);
      continue;
    }
    core.configure(d, config);
  }
  warn_ignored(torch.ignored);
}

std::function<void(CachingAllocator&)> startup_setup(TorchAllocator& adapter, StartupSettings settings) {
  return [&adapter, settings = std::move(settings)](CachingAllocator&) {
    apply_startup(adapter, settings, read_torch_settings());
  };
}

}  // namespace gpumem
