#include "core/stats.h"

namespace gpumem {

const char* const kStatTypeNames[kNumStatTypes] = {"all", "small_pool", "large_pool"};

StatArray StatLedger::Figure::read() const {
  StatArray out;
  out[kAll] = Stat{whole(), whole_peak, increased[0] + increased[1], decreased[0] + decreased[1]};
  out[kSmallPool] = Stat{current[0], peak[0], increased[0], decreased[0]};
  out[kLargePool] = Stat{current[1], peak[1], increased[1], decreased[1]};
  return out;
}

void StatLedger::Figure::reset_peak() {
  peak[0] = current[0];
  peak[1] = current[1];
  whole_peak = whole();
}

void StatLedger::Figure::reset_accumulated() {
  increased[0] = increased[1] = decreased[0] = decreased[1] = 0;
}

DeviceStats StatLedger::snapshot() const {
  DeviceStats out;
#define GPUMEM_READ_FIGURE(name, help) out.name = name##_.read();
  GPUMEM_STAT_ARRAYS(GPUMEM_READ_FIGURE)
#undef GPUMEM_READ_FIGURE
#define GPUMEM_READ_COUNTER(name, help) out.name = name;
  GPUMEM_STAT_COUNTERS(GPUMEM_READ_COUNTER)
#undef GPUMEM_READ_COUNTER
  return out;
}

void StatLedger::reset_peak() {
#define GPUMEM_RESET_FIGURE_PEAK(name, help) name##_.reset_peak();
  GPUMEM_STAT_ARRAYS(GPUMEM_RESET_FIGURE_PEAK)
#undef GPUMEM_RESET_FIGURE_PEAK
}

void StatLedger::reset_accumulated() {
#define GPUMEM_RESET_FIGURE_ACC(name, help) name##_.reset_accumulated();
  GPUMEM_STAT_ARRAYS(GPUMEM_RESET_FIGURE_ACC)
#undef GPUMEM_RESET_FIGURE_ACC
#define GPUMEM_RESET_LEDGER_COUNTER(name, help) name = 0;
  GPUMEM_STAT_COUNTERS(GPUMEM_RESET_LEDGER_COUNTER)
#undef GPUMEM_RESET_LEDGER_COUNTER
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
