#include "torch/history.h"

#include <algorithm>
#include <chrono>
#include <string_view>

namespace gpumem {

std::atomic<int> History::active_count_{0};

namespace {

using TraceEntry = torch_compat::TorchTraceEntry;

// The names torch's snapshot uses for the actions (skip_actions gives them this way).
constexpr std::pair<std::string_view, TraceEntry::Action> kActionNames[] = {
    {"alloc", TraceEntry::ALLOC},
    {"free_requested", TraceEntry::FREE_REQUESTED},
    {"free_completed", TraceEntry::FREE_COMPLETED},
    {"segment_alloc", TraceEntry::SEGMENT_ALLOC},
    {"segment_free", TraceEntry::SEGMENT_FREE},
    {"segment_map", TraceEntry::SEGMENT_MAP},
    {"segment_unmap", TraceEntry::SEGMENT_UNMAP},
    {"snapshot", TraceEntry::SNAPSHOT},
    {"oom", TraceEntry::OOM},
};

std::int64_t now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}

}  // namespace

History::History(int devices) : rings_(devices) {}

History::~History() {
  std::lock_guard<std::mutex> lock(mutex_);
  set_active_locked(false);
}

void History::set_active_locked(bool active) {
  if (active_.exchange(active, std::memory_order_relaxed) != active) active_count_.fetch_add(active ? 1 : -1);
}

void History::configure(bool enabled, CreateContextFn recorder, std::size_t max_entries, RecordContext when, bool clear,
                        const std::vector<std::string>& skip_actions) {
  std::lock_guard<std::mutex> lock(mutex_);
  enabled_ = enabled;
  if (enabled) {
    recorder_ = recorder;
    when_ = when;
    max_entries_ = max_entries;
    std::fill(std::begin(skip_), std::end(skip_), false);
    for (const std::string& name : skip_actions) {
      for (const auto& [known, action] : kActionNames) {
        if (name == known) skip_[action] = true;
      }
    }
  }
  for (Ring& ring : rings_) {
    if (clear) ring = Ring{};
    // Oldest first from index 0, trimmed to the new bound, so the ring can grow or wrap again.
    std::rotate(ring.entries.begin(), ring.entries.begin() + static_cast<std::ptrdiff_t>(ring.next), ring.entries.end());
    ring.next = 0;
    if (ring.entries.size() > max_entries_) {
      ring.entries.erase(ring.entries.begin(), ring.entries.end() - static_cast<std::ptrdiff_t>(max_entries_));
    }
  }
  set_active_locked(enabled_ || !trackers_.empty());
}

bool History::enabled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return enabled_;
}

void History::attach_tracker(Tracker tracker) {
  std::lock_guard<std::mutex> lock(mutex_);
  trackers_.push_back(std::move(tracker));
  set_active_locked(true);
}

void History::stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  enabled_ = false;
  trackers_.clear();
  set_active_locked(false);
}

bool History::wants_context(Action action) const {
  if (!recorder_) return false;
  if (action == TraceEntry::ALLOC) return when_ == RecordContext::ALLOC || when_ == RecordContext::ALL;
  if (action == TraceEntry::FREE_REQUESTED || action == TraceEntry::FREE_COMPLETED) return when_ == RecordContext::ALL;
  return false;
}

void History::record(Action action, int device, std::uintptr_t addr, std::size_t size, StreamId stream, PoolId pool) {
  CreateContextFn recorder = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (enabled_ && wants_context(action)) recorder = recorder_;
  }
  // Gathering a stack can be slow (Python frames); it happens outside the lock.
  std::shared_ptr<c10::GatheredContext> context = recorder ? recorder() : nullptr;
  TraceEntry entry = torch_compat::make_trace_entry(action, static_cast<c10::DeviceIndex>(device), addr, size,
                                                    reinterpret_cast<cudaStream_t>(stream), pool, std::move(context));
  entry.time_.t_ = static_cast<time_t>(now_us());

  std::lock_guard<std::mutex> lock(mutex_);
  for (const Tracker& tracker : trackers_) tracker(entry);
  if (!enabled_ || skip_[action] || max_entries_ == 0 || device < 0 || device >= static_cast<int>(rings_.size())) return;
  Ring& ring = rings_[device];
  if (ring.entries.size() < max_entries_) {
    ring.entries.push_back(std::move(entry));
    return;
  }
  ring.entries[ring.next] = std::move(entry);
  ring.next = (ring.next + 1) % max_entries_;
}

std::vector<std::vector<TraceEntry>> History::traces() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<TraceEntry>> out(rings_.size());
  for (std::size_t d = 0; d < rings_.size(); ++d) {
    const Ring& ring = rings_[d];
    const std::size_t n = ring.entries.size();
    out[d].reserve(n);
    for (std::size_t i = 0; i < n; ++i) out[d].push_back(ring.entries[(ring.next + i) % n]);
  }
  return out;
}

}  // namespace gpumem
