#include "torch/history.h"

#include <algorithm>
#include <chrono>
#include <string_view>
#include <utility>

#include "core/errors.h"

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

void warn_quietly(const char* what, const char* why) noexcept {
  quietly([&] { TORCH_WARN("gpumem: ", what, ": ", why); });
}

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
  bool skip[kActions] = {};
  for (const std::string& name : skip_actions) {
    const auto* known = std::find_if(std::begin(kActionNames), std::end(kActionNames),
                                     [&](const auto& entry) { return entry.first == name; });
    TORCH_CHECK(known != std::end(kActionNames), "gpumem: unknown action '", name.substr(0, 64),
                "' in skip_actions; the actions are alloc, free_requested, free_completed, segment_alloc, "
                "segment_free, segment_map, segment_unmap, snapshot, oom");
    skip[known->second] = true;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  enabled_ = enabled;
  if (enabled) {
    recorder_ = recorder;
    when_ = when;
    max_entries_ = std::max<std::size_t>(1, max_entries);
    std::copy(std::begin(skip), std::end(skip), std::begin(skip_));
  } else {
    recorder_ = nullptr;
    when_ = RecordContext::NEVER;
    // As native, the stacks of live blocks and segments stay (Note [stacks kept after recording]);
    // the notes of frees do not, since no free is noted from here on.
    freed_.clear();
  }
  for (Ring& ring : rings_) {
    if (clear || !enabled) ring = Ring{};
    // Oldest first from index 0, trimmed to the new bound, so the ring can grow or wrap again.
    std::rotate(ring.entries.begin(), ring.entries.begin() + static_cast<std::ptrdiff_t>(ring.next), ring.entries.end());
    ring.next = 0;
    if (ring.entries.size() > max_entries_) {
      ring.entries.erase(ring.entries.begin(), ring.entries.end() - static_cast<std::ptrdiff_t>(max_entries_));
    }
  }
  set_active_locked(listened_locked());
}

bool History::listened_locked() const {
  return enabled_ || !trackers_.empty() || !contexts_[kBlocks].empty() || !contexts_[kSegments].empty();
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
  recorder_ = nullptr;
  trackers_.clear();
  for (auto& map : contexts_) map.clear();
  freed_.clear();
  set_active_locked(false);
}

History::Context History::gather(RecordContext level) const {
  CreateContextFn recorder = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (keeps(level)) recorder = recorder_;
  }
  if (!recorder) return nullptr;
  // A recorder that fails costs the entry its stack, never the allocation or the free around it.
  try {
    return recorder();
  } catch (const std::exception& e) {
    warn_quietly("a stack could not be recorded for the memory history", e.what());
  } catch (...) {
    warn_quietly("a stack could not be recorded for the memory history", "unknown error");
  }
  return nullptr;
}

void History::push_compile_context(std::string name) {
  std::lock_guard<std::mutex> lock(mutex_);
  compile_contexts_.push_back(std::move(name));
}

void History::pop_compile_context() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!compile_contexts_.empty()) compile_contexts_.pop_back();
}

void History::set_user_metadata(std::string metadata) {
  std::lock_guard<std::mutex> lock(mutex_);
  user_metadata_ = std::move(metadata);
}

std::string History::user_metadata() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return user_metadata_;
}

void History::record(Action action, int device, std::uintptr_t addr, std::size_t size, StreamId stream, PoolId pool,
                     Context context) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!enabled_ && trackers_.empty()) return;  // active only to follow kept stacks: no entry to make
  const std::int64_t time = now_us();
  TraceEntry entry = torch_compat::make_trace_entry(action, static_cast<c10::DeviceIndex>(device), addr, size,
                                                    reinterpret_cast<cudaStream_t>(stream), pool,
                                                    keeps(RecordContext::ALLOC) ? std::move(context) : nullptr);
  entry.time_.t_ = static_cast<time_t>(time);
  torch_compat::tag_trace_entry(entry, compile_contexts_.empty() ? "N/A" : compile_contexts_.back(), user_metadata_);
  // The entry describes memory that has already changed hands (a segment reserved from the
  // device, a block freed): a tracker that throws must not undo that halfway.
  for (const Tracker& tracker : trackers_) {
    try {
      tracker(entry);
    } catch (const std::exception& e) {
      warn_quietly("an allocator trace tracker failed", e.what());
    } catch (...) {
      warn_quietly("an allocator trace tracker failed", "unknown error");
    }
  }
  if (!enabled_ || skip_[action] || max_entries_ == 0 || device < 0 || device >= static_cast<int>(rings_.size())) return;
  Ring& ring = rings_[device];
  if (ring.entries.size() < max_entries_) {
    ring.entries.push_back(std::move(entry));
    return;
  }
  ring.entries[ring.next] = std::move(entry);
  ring.next = (ring.next + 1) % max_entries_;
}

void History::remember(Table table, int device, std::uintptr_t addr, Context context) {
  if (!context) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (keeps(RecordContext::STATE)) contexts_[table][{device, addr}] = std::move(context);
}

History::Context History::forget(Table table, int device, std::uintptr_t addr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto node = contexts_[table].extract({device, addr});
  if (node && !enabled_) set_active_locked(listened_locked());  // the last kept stack gone: quiet again
  return node ? std::move(node.mapped()) : nullptr;
}

History::Context History::context(Table table, int device, std::uintptr_t addr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto& map = contexts_[table];
  auto it = map.find({device, addr});
  return it == map.end() ? nullptr : it->second;
}

void History::note_free(int device, std::uintptr_t addr, std::size_t requested) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (enabled_) freed_[{device, addr}] = Freed{++frees_, requested};
}

void History::drop_frees(int device, std::uintptr_t addr, std::size_t size) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (freed_.empty()) return;
  freed_.erase(freed_.lower_bound({device, addr}), freed_.lower_bound({device, addr + size}));
}

std::size_t History::last_freed_within(int device, std::uintptr_t addr, std::size_t size) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Freed* latest = nullptr;
  for (auto it = freed_.lower_bound({device, addr}); it != freed_.end() && it->first < Key{device, addr + size}; ++it) {
    if (!latest || it->second.order > latest->order) latest = &it->second;
  }
  return latest ? latest->requested : 0;
}

std::vector<std::vector<TraceEntry>> History::traces(int devices) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<TraceEntry>> out(devices);
  for (std::size_t d = 0; d < out.size() && d < rings_.size(); ++d) {
    const Ring& ring = rings_[d];
    const std::size_t n = ring.entries.size();
    out[d].reserve(n);
    for (std::size_t i = 0; i < n; ++i) out[d].push_back(ring.entries[(ring.next + i) % n]);
  }
  return out;
}

}  // namespace gpumem
