#include "core/stats.h"

namespace gpumem {

const char* const kStatTypeNames[kNumStatTypes] = {"all", "small_pool", "large_pool"};

void DeviceStats::reset_peak() {
#define GPUMEM_RESET_PEAK(name, help) \
  for (Stat& s : name) s.reset_peak();
  GPUMEM_STAT_ARRAYS(GPUMEM_RESET_PEAK)
#undef GPUMEM_RESET_PEAK
}

void DeviceStats::reset_accumulated() {
#define GPUMEM_RESET_ACC(name, help) \
  for (Stat& s : name) s.reset_accumulated();
  GPUMEM_STAT_ARRAYS(GPUMEM_RESET_ACC)
#undef GPUMEM_RESET_ACC
#define GPUMEM_RESET_COUNTER(name, help) name = 0;
  GPUMEM_STAT_COUNTERS(GPUMEM_RESET_COUNTER)
#undef GPUMEM_RESET_COUNTER
}

namespace {

void flatten_array(std::vector<StatEntry>& out, const char* name, const StatArray& array) {
  for (int t = 0; t < kNumStatTypes; ++t) {
    const std::string prefix = std::string(name) + "." + kStatTypeNames[t] + ".";
    out.emplace_back(prefix + "current", array[t].current);
    out.emplace_back(prefix + "peak", array[t].peak);
    out.emplace_back(prefix + "allocated", array[t].allocated);
    out.emplace_back(prefix + "freed", array[t].freed);
  }
}

}  // namespace

std::vector<StatEntry> flatten(const DeviceStats& stats) {
  std::vector<StatEntry> out;
#define GPUMEM_FLATTEN_ARRAY(name, help) flatten_array(out, #name, stats.name);
  GPUMEM_STAT_ARRAYS(GPUMEM_FLATTEN_ARRAY)
#undef GPUMEM_FLATTEN_ARRAY
#define GPUMEM_FLATTEN_COUNTER(name, help) out.emplace_back(#name, stats.name);
  GPUMEM_STAT_COUNTERS(GPUMEM_FLATTEN_COUNTER)
#undef GPUMEM_FLATTEN_COUNTER
  return out;
}

}  // namespace gpumem
