// The statistics ledger (core/stats.h): snapshots and resets.
#include "core/stats.h"

#include <tuple>

namespace gpumem {

const char* const kStatTypeNames[kNumStatTypes] = {"all", "small_pool", "large_pool"};

namespace {

std::int64_t larger(std::int64_t a, std::int64_t b) { return a > b ? a : b; }

}  // namespace

StatArray StatLedger::Figure::read() const {
  StatArray out;
  out[kAll] = Stat{whole(), whole_peak, increased(0) + increased(1), decreased[0] + decreased[1]};
  out[kSmallPool] = Stat{current[0], peak[0], increased(0), decreased[0]};
  out[kLargePool] = Stat{current[1], peak[1], increased(1), decreased[1]};
  return out;
}

void StatLedger::Figure::reset_peak() {
  peak[0] = current[0];
  peak[1] = current[1];
  whole_peak = whole();
}

void StatLedger::Figure::reset_accumulated() {
  base[0] = current[0];
  base[1] = current[1];
  decreased[0] = decreased[1] = 0;
}

void StatLedger::Figure::take_in(Figure* const* parts, int count) {
  std::int64_t rise[2] = {0, 0};
  std::int64_t whole_rise = 0;
  for (int i = 0; i < count; ++i) {
    rise[0] += parts[i]->peak[0];
    rise[1] += parts[i]->peak[1];
    whole_rise += parts[i]->whole_peak;
  }
  peak[0] = larger(peak[0], current[0] + rise[0]);
  peak[1] = larger(peak[1], current[1] + rise[1]);
  whole_peak = larger(whole_peak, whole() + whole_rise);
  for (int i = 0; i < count; ++i) {
    Figure& part = *parts[i];
    for (int t = 0; t < 2; ++t) {
      current[t] += part.current[t];
      decreased[t] += part.decreased[t];
    }
    part = Figure{};
  }
}

void StatLedger::take_in(StatLedger* const* lanes, int count) {
  Figure* parts[kMaxParts] = {};
  auto take = [&](Figure& mine, Figure StatLedger::*figure) {
    for (int i = 0; i < count; ++i) parts[i] = &(lanes[i]->*figure);
    mine.take_in(parts, count);
  };
#define GPUMEM_TAKE_IN_FIGURE(name, help) take(name##_, &StatLedger::name##_);
  GPUMEM_STAT_ARRAYS(GPUMEM_TAKE_IN_FIGURE)
#undef GPUMEM_TAKE_IN_FIGURE
  take(pending_, &StatLedger::pending_);
  take(pending_bytes_, &StatLedger::pending_bytes_);
  for (int i = 0; i < count; ++i) {
#define GPUMEM_TAKE_IN_COUNTER(name, help) \
  name##_ += lanes[i]->name##_;            \
  lanes[i]->name##_ = 0;
    GPUMEM_STAT_COUNTERS(GPUMEM_TAKE_IN_COUNTER)
#undef GPUMEM_TAKE_IN_COUNTER
  }
}

void StatLedger::note_active_peak(int t) {
  for (auto [own, allocated, pending] : {std::tuple<Figure*, const Figure*, const Figure*>{&active_, &allocation_, &pending_},
                                         {&active_bytes_, &allocated_bytes_, &pending_bytes_}}) {
    own->peak[t] = larger(own->peak[t], allocated->current[t] + pending->current[t]);
    own->whole_peak = larger(own->whole_peak, allocated->whole() + pending->whole());
  }
}

// Active has increased only at hand_out, so its accumulated increases are allocation's; it has
// decreased at every release not followed by pend() and at every retire(): allocation's decreases
// less the pend()s since the last reset.
StatArray StatLedger::read_active(const Figure& allocated, const Figure& pending, const Figure& own) {
  StatArray out;
  for (int t = 0; t < 2; ++t) {
    Stat& s = out[t == 0 ? kSmallPool : kLargePool];
    s.current = allocated.current[t] + pending.current[t];
    s.peak = larger(allocated.peak[t], own.peak[t]);
    s.allocated = allocated.increased(t);
    s.freed = allocated.decreased[t] - (pending.current[t] - pending.base[t]);
  }
  const Stat& small = out[kSmallPool];
  const Stat& large = out[kLargePool];
  out[kAll] = Stat{small.current + large.current, larger(allocated.whole_peak, own.whole_peak),
                   small.allocated + large.allocated, small.freed + large.freed};
  return out;
}

void StatLedger::reset_active_peak(Figure& own, const Figure& allocated, const Figure& pending) {
  own.peak[0] = allocated.current[0] + pending.current[0];
  own.peak[1] = allocated.current[1] + pending.current[1];
  own.whole_peak = allocated.whole() + pending.whole();
}

DeviceStats StatLedger::snapshot() const {
  DeviceStats out;
#define GPUMEM_READ_FIGURE(name, help) out.name = name##_.read();
  GPUMEM_STAT_ARRAYS(GPUMEM_READ_FIGURE)
#undef GPUMEM_READ_FIGURE
  out.active = read_active(allocation_, pending_, active_);
  out.active_bytes = read_active(allocated_bytes_, pending_bytes_, active_bytes_);
#define GPUMEM_READ_COUNTER(name, help) out.name = name##_;
  GPUMEM_STAT_COUNTERS(GPUMEM_READ_COUNTER)
#undef GPUMEM_READ_COUNTER
  return out;
}

void StatLedger::reset_peak() {
#define GPUMEM_RESET_FIGURE_PEAK(name, help) name##_.reset_peak();
  GPUMEM_STAT_ARRAYS(GPUMEM_RESET_FIGURE_PEAK)
#undef GPUMEM_RESET_FIGURE_PEAK
  reset_active_peak(active_, allocation_, pending_);
  reset_active_peak(active_bytes_, allocated_bytes_, pending_bytes_);
}

void StatLedger::reset_accumulated() {
#define GPUMEM_RESET_FIGURE_ACC(name, help) name##_.reset_accumulated();
  GPUMEM_STAT_ARRAYS(GPUMEM_RESET_FIGURE_ACC)
#undef GPUMEM_RESET_FIGURE_ACC
  pending_.reset_accumulated();
  pending_bytes_.reset_accumulated();
#define GPUMEM_RESET_LEDGER_COUNTER(name, help) name##_ = 0;
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
