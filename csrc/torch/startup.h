// The settings gpumem is installed with, applied when the devices are first used.
//
// gpumem is installed at torch's import (GPUMEM_LIMIT) or by the program's first gpumem call, and
// must not start CUDA then (Note [no CUDA before first use], backends/cuda_backend.cpp). What the
// settings mean on a device (a percentage of it, whether it exists) is worked out later, by the
// core's deferred setup, once: at torch's lazy CUDA init, or the first call that needs a device.
//
// Note [which setting wins]
//   From weakest to strongest, per setting:
//   1. torch's allocator settings (PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF, or
//      _set_allocator_settings before CUDA starts): per_process_memory_fraction caps, as native;
//      expandable_segments picks growable or plain segments where the settings name it;
//      garbage_collection_threshold becomes the release threshold;
//   2. gpumem's environment: GPUMEM_LIMIT, GPUMEM_SEGMENTS, GPUMEM_SCOPE, GPUMEM_CHUNK;
//   3. gpumem's own calls (set_limit, set_segments, set_release_threshold) and
//      torch.cuda.set_per_process_memory_fraction, made at any time: the last call holds.
//   Two caps from 1 and 2 both hold: the lower one applies. The settings torch has and gpumem has
//   no use for (max_split_size_mb, max_non_split_rounding_mb, large_segment_size_mb,
//   release_lock_on_cudamalloc) are named in one warning.
#pragma once

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/caching_allocator.h"

namespace gpumem {

class TorchAllocator;

struct StartupSettings {
  std::optional<std::string> limits;  // GPUMEM_LIMIT's text; its syntax was checked at install
  std::optional<bool> growable;       // GPUMEM_SEGMENTS
  std::optional<LimitScope> scope;    // GPUMEM_SCOPE
  std::optional<std::size_t> chunk;   // GPUMEM_CHUNK: AllocatorConfig::large_chunk
};

// What torch's allocator settings ask of gpumem.
struct TorchSettings {
  double fraction = 1.0;                     // per_process_memory_fraction; 1 is no cap
  std::optional<bool> growable;              // expandable_segments, where the settings name it
  std::optional<double> release_threshold;   // garbage_collection_threshold, where it is set
  std::vector<std::string> ignored;          // settings gpumem has no use for, as named
};

// GPUMEM_LIMIT's bytes for each device, of `totals` bytes each (nullopt: no limit from it).
// Throws LimitSpecError, naming GPUMEM_LIMIT and its value: a device it names is not there, or a
// spec does not fit its device.
std::vector<std::optional<std::size_t>> resolve_limit_text(const std::string& text,
                                                           const std::vector<std::size_t>& totals);

// The keys a settings string sets ("a:1,b:[2,3]" -> {a, b}); brackets hold lists.
std::set<std::string> setting_keys(std::string_view text);

// torch's settings as parsed now, where `text` (default: the settings torch parsed last) names them.
// Throws torch's own error for an invalid value.
TorchSettings read_torch_settings(std::optional<std::string_view> text = std::nullopt);

// The setup for `adapter`'s CachingAllocator::defer_setup: applies `settings` and torch's settings
// to every device, and tells the adapter the fraction it applied (getMemoryFraction reads it back).
// Throws LimitSpecError, DeviceError or torch's error, naming the setting and its value, having
// changed nothing.
std::function<void(CachingAllocator&)> startup_setup(TorchAllocator& adapter, StartupSettings settings);

// The same over settings already read: what startup_setup does after reading torch's.
void apply_startup(TorchAllocator& adapter, const StartupSettings& settings, const TorchSettings& torch);

// torch's settings changed at run time (torch._C._accelerator_setAllocatorSettings(text), after
// torch parsed `text`): what `text` names of expandable_segments and garbage_collection_threshold
// applies to every device now, as native reads those at each use, except what gpumem's own
// settings fixed (`keep_segments`: GPUMEM_SEGMENTS or set_segments; `keep_threshold`:
// set_release_threshold). per_process_memory_fraction applies only before the devices are set
// up, as native reads it once per device. Before the setup has run this does nothing: the setup
// reads the settings then.
void apply_changed_torch_settings(CachingAllocator& core, std::string_view text, bool keep_segments,
                                  bool keep_threshold);

}  // namespace gpumem
