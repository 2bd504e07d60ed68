// gpumem's DeviceStats -> torch's c10 DeviceStats.
//
// Both follow the native allocator's meanings (core/stats.h), so the mapping is by name: every
// statistic in GPUMEM_STAT_ARRAYS and GPUMEM_STAT_COUNTERS is copied to the c10 field of the same
// name when torch has one. A statistic added to those lists is mapped with no change here; one
// torch lacks (num_cache_releases, the cases of num_ooms) is left out, visible through
// gpumem.stats() only.
#pragma once

#include "core/stats.h"
#include "torch/compat.h"

namespace gpumem {

torch_compat::TorchDeviceStats to_torch_stats(const DeviceStats& stats);

}  // namespace gpumem
