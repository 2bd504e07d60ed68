#include "torch/stats_mapping.h"

#include <type_traits>

namespace gpumem {

namespace {

using TorchStats = torch_compat::TorchDeviceStats;

template <class TorchStat>
void copy_stat(TorchStat& to, const Stat& from) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

template <class TorchArray>
void copy_value(TorchArray& to, const StatArray& from) {
  for (int t = 0; t < kNumStatTypes; ++t) copy_stat(to[t], from[t]);
}

void copy_value(std::int64_t& to, std::int64_t from) { to = from; }

// `field(out)` names torch's member of the same name; when torch has none, the generic lambda
// below is not invocable and the statistic is skipped at compile time.
template <class Field, class Value>
void copy_if_torch_has(TorchStats& out, Field field, const Value& value) {
  if constexpr (std::is_invocable_v<Field, TorchStats&>) copy_value(field(out), value);
}

}  // namespace

TorchStats to_torch_stats(const DeviceStats& stats) {
  TorchStats out;
#define GPUMEM_MAP_STAT(name, help) \
  copy_if_torch_has(out, [](auto& s) -> decltype((s.name)) { return s.name; }, stats.name);
  GPUMEM_STAT_ARRAYS(GPUMEM_MAP_STAT)
  GPUMEM_STAT_COUNTERS(GPUMEM_MAP_STAT)
#undef GPUMEM_MAP_STAT
  return out;
}

}  // namespace gpumem
