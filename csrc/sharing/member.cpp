// One process's member of a shared GPU (sharing/member.h): joining, publishing, answering, asking,
// the shared ceiling and the floors.
#include "sharing/member.h"

#include <algorithm>
#include <unistd.h>

#include "core/device_allocator.h"
#include "core/errors.h"

namespace gpumem {

namespace {

// Whether `served` has reached `wanted` (both wrap at 2^32).
bool reached(std::uint32_t served, std::uint32_t wanted) { return static_cast<std::int32_t>(served - wanted) >= 0; }

ShareMemberView view_of(const SlotCopy& c) { return {c.pid, c.same_pid_namespace, c.floor, c.reserved, c.in_use}; }

ShareTally tally_of(const std::vector<SlotCopy>& copies) {
  ShareTally tally;
  for (const SlotCopy& c : copies) tally.add({c.floor, c.reserved, c.in_use});
  return tally;
}

std::string pid_text(const SlotCopy& c) {
  return "pid " + std::to_string(c.pid) + (c.same_pid_namespace ? "" : " (of another pid namespace)");
}

}  // namespace

// ---- DeviceHost: the member's calls into its own device ----

std::size_t DeviceHost::reserved() { return device_.reserved(); }
std::size_t DeviceHost::in_use() {
  const std::int64_t bytes = device_.stats().allocated_bytes[kAll].current;
  return bytes > 0 ? static_cast<std::size_t>(bytes) : 0;
}
std::size_t DeviceHost::give_back(std::size_t bytes) {
  if (bytes < SIZE_MAX) return device_.release_for_others(bytes);
  const std::size_t before = device_.reserved();
  device_.empty_cache();
  const std::size_t after = device_.reserved();
  return before > after ? before - after : 0;
}
void DeviceHost::set_ceiling(std::size_t bytes) { device_.set_shared_ceiling(bytes); }
std::optional<MemInfo> DeviceHost::mem_info() { return device_.mem_info_outside_capture(); }

// ---- joining ----

ShareClient::ShareClient(const std::string& path, ShareHost& host, std::size_t device_total, ShareOptions options,
                         std::uint32_t pid)
    : path_(path),
      host_(host),
      total_(device_total),
      options_(options),
      pid_(pid != 0 ? pid : static_cast<std::uint32_t>(::getpid())),
      process_(static_cast<int>(::getpid())) {
  join();
}

ShareClient::~ShareClient() {
  if (forked()) {
    // A forked child's copy: the responder thread is its parent's, not here to join.
    if (responder_.joinable()) responder_.detach();
    return;
  }
  stop();
  const Joined j = joined();
  j.table->release(j.index);
}

void ShareClient::join() {
  auto table = std::make_shared<ShareTable>(path_, options_.lock_wait);
  const std::uint32_t index = table->claim(pid_);
  if (index >= ShareTable::kSlots) {
    if (std::string why = table->damaged(); !why.empty()) {
      throw ShareError("gpumem: sharing: " + path_ + " " + why + " while this process joined; not sharing");
    }
    throw ShareError("gpumem: sharing: every one of the " + std::to_string(ShareTable::kSlots) + " slots of " + path_ +
                     " is held by a live process; not sharing");
  }
  std::uint32_t asks = 0;
  table->asks_of(index, asks);
  answered_.store(asks, std::memory_order_relaxed);
  {
    const std::lock_guard<std::mutex> guard(joined_mutex_);
    joined_ = {std::move(table), index};
  }
  publish(joined());
}

ShareClient::Joined ShareClient::joined() const {
  const std::lock_guard<std::mutex> guard(joined_mutex_);
  return joined_;
}

std::uint32_t ShareClient::slot_index() const { return joined().index; }

void ShareClient::start() {
  if (responder_.joinable() || forked()) return;
  stopping_.store(false);
  responder_ = std::thread([this] { respond_loop(); });
}

void ShareClient::stop() {
  if (!responder_.joinable() || forked()) return;
  stopping_.store(true);
  const Joined j = joined();
  j.table->wake(j.index);
  responder_.join();
}

// ---- what this member says and follows ----

void ShareClient::publish(const Joined& j) {
  j.table->publish(j.index, {floor_.load(std::memory_order_relaxed), host_.reserved(), host_.in_use()});
  j.table->count(j.index, asks_served_.load(std::memory_order_relaxed), given_back_.load(std::memory_order_relaxed),
                 asks_made_.load(std::memory_order_relaxed));
}

std::vector<SlotCopy> ShareClient::others(const Joined& j) const {
  std::vector<SlotCopy> copies;
  if (!j.table->read_others(j.index, total_, copies)) copies.clear();
  return copies;
}

// The ceiling the others' claims leave this member, from the table and a fresh reading of the
// device (not while a graph may be capturing: the last reading stands), put in the cap.
std::size_t ShareClient::refresh_ceiling(const Joined& j) {
  const ShareTally tally = tally_of(others(j));
  const std::size_t ceiling = share_ceiling(total_, measure_unaccounted(tally), tally);
  set_ceiling(ceiling);
  return ceiling;
}

// What the device holds outside every member, from a fresh reading (not while a graph may be
// capturing: the last reading stands).
std::size_t ShareClient::measure_unaccounted(const ShareTally& others) {
  if (const std::optional<MemInfo> mem = host_.mem_info()) {
    unaccounted_.store(unaccounted(total_, mem->free, host_.reserved(), others), std::memory_order_relaxed);
  }
  return unaccounted_.load(std::memory_order_relaxed);
}

// How much of `floor` the device cannot give now: what the others' claims and what the device
// holds outside them leave, or what this member holds already, whichever is more (a stale figure
// of another never makes it short of what it has).
std::size_t ShareClient::shortfall(std::size_t floor, std::size_t unaccounted_bytes, const ShareTally& others) {
  const std::size_t room = std::max(host_.reserved(), share_room(total_, unaccounted_bytes, others));
  return floor > room ? floor - room : 0;
}

void ShareClient::set_ceiling(std::size_t ceiling) {
  const std::lock_guard<std::mutex> guard(ceiling_mutex_);
  if (ceiling == ceiling_.load(std::memory_order_relaxed)) return;
  host_.set_ceiling(ceiling);
  ceiling_.store(ceiling, std::memory_order_relaxed);
}

// Note [a table cut under its mapping] (sharing/table.cpp): a fresh table, a slot again, and the
// floor granted again there (the others may have taken floors meanwhile).
void ShareClient::rejoin(const std::string& why) {
  try {
    floor_.store(0, std::memory_order_relaxed);
    join();
    {
      const std::lock_guard<std::mutex> guard(slow_mutex_);
      slow_.clear();  // the asks counters started again
    }
    if (const std::size_t asked = floor_asked_.load(std::memory_order_relaxed)) grant(joined(), asked);
    const std::lock_guard<std::mutex> guard(problem_mutex_);
    problem_.clear();
  } catch (const std::exception& error) {
    {
      const std::lock_guard<std::mutex> guard(problem_mutex_);
      problem_ = path_ + " " + why + ", and no fresh table could be joined (" + error.what() +
                 "): this process is alone until one can";
    }
    set_ceiling(SIZE_MAX);
    throw;
  }
}

void ShareClient::follow_now() {
  if (forked()) return;
  Joined j = joined();
  if (std::string why = j.table->damaged(); !why.empty()) {
    rejoin(why);  // throws where it cannot: the responder tries again next round
    j = joined();
  }
  const std::lock_guard<std::mutex> guard(answering_);
  std::uint32_t asks = 0;
  // This process's own record says what it answered: a `served` written ahead by another process
  // cannot silence it.
  const bool asked = j.table->asks_of(j.index, asks) && asks != answered_.load(std::memory_order_relaxed);
  if (asked) {
    std::size_t wanted = 0;
    if (j.table->take_wanted(j.index, wanted) && wanted > 0) {
      // Fresh figures first: the asker reads from them whether our cache holds what it lacks,
      // and maps while we release (Note [handing memory over while it is released]).
      publish(j);
      given_back_.fetch_add(host_.give_back(wanted), std::memory_order_relaxed);
    }
    asks_served_.fetch_add(1, std::memory_order_release);  // a reader that sees it counted sees given_back_
  }
  publish(j);
  refresh_ceiling(j);
  if (asked) {  // last: an asker that sees the answer sees the figures and the ceiling that follow it
    j.table->mark_served(j.index, asks);
    answered_.store(asks, std::memory_order_relaxed);
  }
}

// The responder: answers requests, publishes its figures and follows the others' floors. What the
// device allocator throws here (a broken driver) must not end the process: it is dropped, and the
// next round tries again.
void ShareClient::respond_loop() {
  while (!stopping_.load()) {
    try {
      const Joined j = joined();
      std::uint32_t asks = 0;
      if (!j.table->asks_of(j.index, asks)) {
        std::this_thread::sleep_for(options_.poll);  // a cut table: rejoined below, a round at a time
      } else if (asks == answered_.load(std::memory_order_relaxed)) {
        j.table->wait_for_ask(j.index, asks, options_.poll);
      }
      if (stopping_.load()) break;
      follow_now();
    } catch (...) {
      std::this_thread::sleep_for(options_.poll);
    }
  }
}

// ---- asking ----

void ShareClient::ask(const AskFor& need, const StillNeeded& still_needed) noexcept {
  try {
    // Where only the ceiling refused, a fresh one may be enough (its last round was up to a poll
    // ago): the others are asked only if it is not.
    if (need.budget_needed > 0 && !forked() && refresh_ceiling(joined()) >= need.budget_needed) return;
    ask_others(need.device_bytes, still_needed);
  } catch (...) {
    // Nothing was given back: the request fails as it would have alone.
  }
}

// Note [handing memory over while it is released]. A request the device refused needs what the
// device lacks, not the others' whole caches. So the asker asks for that many bytes, split over
// the members that cache most first (their published reserved less in use), and each gives back
// its largest cached blocks until it released its share, a chunk more at most, a step at a time
// (DeviceAllocator::release_for_others). Meanwhile the asker calls still_needed, which maps the
// memory the device holds by then of the request's own growth (Note [mapping while the others
// release], core/growable_segments.cpp), so that its mapping overlaps their release: the wait
// ends once still_needed reports 0, or once every member asked has answered and a call after the
// answers still lacks memory. Where the figures the split came from were stale (a member gave
// less than its share), the asker asks again for what it still lacks, kAskRounds times at most,
// all within one ask_wait, while the others' fresh figures say their cache holds it. Where their
// cache cannot hold what the device lacks, nothing is mapped ahead (within_their_cache). Figures
// are published once a responder's round (20 ms), so a member that has just freed its tensors
// looks as if it cached nothing: an asked member publishes before it releases, and the asker,
// while it waits, reads their figures again until they hold what it lacks (on an H100, 47.5 GiB
// asked of a member that had freed it a few ms before took 0.116 s where the figures were read
// once, as the asker mapped only after the answer). Without a byte count (a floor, or the shared
// ceiling in the way), each member gives back all of its cache.
namespace {
constexpr int kAskRounds = 3;
std::size_t cache_of(const SlotCopy& c) { return c.reserved - c.in_use; }  // in_use <= reserved as read
// Whether the others' cache, by their figures, holds `lacking`. Where it does not, the request
// cannot be served however they answer: it asks once, maps nothing ahead (memory mapped for it
// would only be taken back by another asker, two full processes passing it to and fro) and
// fails at the retry, as fast as an ask goes.
bool within_their_cache(const std::vector<SlotCopy>& copies, std::size_t lacking) {
  std::size_t cached = 0;
  for (const SlotCopy& c : copies) cached = saturating_add(cached, cache_of(c));
  return cached >= lacking;
}
}  // namespace

bool ShareClient::ask_others(std::size_t device_bytes, const StillNeeded& still_needed) {
  if (forked()) return false;
  const Joined j = joined();
  std::vector<SlotCopy> copies = others(j);
  asks_made_.fetch_add(1, std::memory_order_relaxed);
  if (copies.empty()) {  // nobody to ask; the ceiling may still be of members that left
    publish(j);
    refresh_ceiling(j);
    return false;
  }
  const auto deadline = std::chrono::steady_clock::now() + options_.ask_wait;
  std::size_t lacking = SIZE_MAX;
  Handover handover;
  if (device_bytes > 0) {  // chunk-accurate (GrowableSegments::most_mapped_for): no page-by-page growth after
    const std::optional<MemInfo> mem = host_.mem_info();
    lacking = mem && mem->free < device_bytes ? device_bytes - mem->free : device_bytes;
    handover.still_needed = still_needed ? &still_needed : nullptr;
    handover.on = handover.still_needed && within_their_cache(copies, lacking);
  }
  for (int round = 1;; ++round) {
    std::vector<Asked> waited = ask_round(j, copies, lacking);
    publish(j);
    const bool answered = wait_for(j, waited, deadline, handover, lacking);
    // Without handing over (their figures, up to a poll old, did not hold it), the answers end it:
    // the retry finds what they gave.
    if (!handover.on || lacking == 0 || !answered || round == kAskRounds) break;
    copies = others(j);  // fresh figures: those answered publish theirs before they mark the answer
    if (!within_their_cache(copies, lacking)) break;
  }
  refresh_ceiling(j);
  return true;
}

std::vector<ShareClient::Asked> ShareClient::ask_round(const Joined& j, const std::vector<SlotCopy>& copies,
                                                      std::size_t lacking) {
  std::vector<std::pair<const SlotCopy*, std::size_t>> shares;
  if (lacking == SIZE_MAX) {
    for (const SlotCopy& c : copies) shares.emplace_back(&c, SIZE_MAX);
  } else {
    std::vector<const SlotCopy*> order;
    for (const SlotCopy& c : copies) order.push_back(&c);
    std::stable_sort(order.begin(), order.end(), [](const SlotCopy* a, const SlotCopy* b) { return cache_of(*a) > cache_of(*b); });
    std::size_t left = lacking;
    for (const SlotCopy* c : order) {
      const std::size_t share = std::min(cache_of(*c), left);
      if (share == 0) break;
      shares.emplace_back(c, share);
      left -= share;
    }
    // What the figures do not place goes to the member caching most: its figures may be a poll old.
    if (left > 0 && !order.empty()) {
      if (shares.empty()) shares.emplace_back(order.front(), 0);
      shares.front().second = saturating_add(shares.front().second, left);
    }
  }
  std::vector<Asked> waited;
  const std::lock_guard<std::mutex> guard(slow_mutex_);
  for (const auto& [c, bytes] : shares) {
    std::uint32_t wanted = 0;
    if (!j.table->ask(c->index, bytes, wanted)) continue;
    // A member that let an earlier ask time out is not waited for again until it answered that
    // one: a stopped or silent process costs one wait, not one a request.
    const auto slow = std::find_if(slow_.begin(), slow_.end(), [&](const auto& s) { return s.first == c->index; });
    if (slow != slow_.end() && !reached(c->served, slow->second)) continue;
    if (slow != slow_.end()) slow_.erase(slow);
    waited.push_back({c->index, wanted});
  }
  return waited;
}

// Waits for the members in `waited` to answer. While handing over, it calls `still_needed`
// meanwhile and once after the last answer, its figure in `lacking`; where the handover may start
// but is not on yet (the others' figures, up to a poll old, did not hold `lacking`), it turns on
// once their fresh figures do: an asked member publishes before it releases. True once they all
// answered or `still_needed` reports 0; false at the deadline (those that did not answer are noted
// slow).
bool ShareClient::wait_for(const Joined& j, std::vector<Asked>& waited, std::chrono::steady_clock::time_point deadline,
                           Handover& handover, std::size_t& lacking) {
  for (;;) {
    std::vector<Asked> unanswered;
    for (const Asked& a : waited) {
      std::uint32_t served = 0;
      // An answer, or a member that went away (its memory went with it), ends the wait for it.
      if (!j.table->owned_by_another(a.index)) continue;
      if (j.table->served(a.index, served) && reached(served, a.wanted)) continue;
      unanswered.push_back(a);
    }
    waited.swap(unanswered);
    const std::size_t before = lacking;
    if (handover.still_needed && !handover.on) handover.on = within_their_cache(others(j), lacking);
    if (handover.on) {
      lacking = (*handover.still_needed)();
      if (lacking == 0) return true;
    }
    if (waited.empty()) return true;
    if (std::chrono::steady_clock::now() >= deadline) {
      asks_timed_out_.fetch_add(1, std::memory_order_relaxed);
      const std::lock_guard<std::mutex> guard(slow_mutex_);
      for (const Asked& a : waited) slow_.emplace_back(a.index, a.wanted);
      return false;
    }
    // Memory came back and was mapped: look again at once; else a short nap.
    if (lacking >= before) std::this_thread::sleep_for(std::chrono::microseconds(handover.still_needed ? 200 : 1000));
  }
}

// ---- floors ----

// Granted under the table's lock, from what the others' floors leave: two floors asked at once
// are granted one after the other, and add up to the device at most.
FloorGrant ShareClient::set_floor(std::size_t bytes) {
  floor_asked_.store(bytes, std::memory_order_relaxed);
  const Joined j = joined();
  FloorGrant g = grant(j, bytes);
  // The others answer with fresh figures, and their free cache first goes back for the floor.
  if (g.granted > 0) ask_others();
  const ShareTally tally = tally_of(others(j));
  g.short_now = shortfall(g.granted, measure_unaccounted(tally), tally);
  return g;
}

FloorGrant ShareClient::grant(const Joined& j, std::size_t bytes) {
  FloorGrant g;
  g.asked = bytes;
  j.table->exclusively([&] {
    std::vector<SlotCopy> copies;
    if (!j.table->read_others(j.index, total_, copies)) {
      throw ShareError("gpumem: sharing: " + path_ + " " + j.table->damaged() + " while a floor was granted");
    }
    std::size_t floors = 0;
    for (const SlotCopy& c : copies) {
      floors = saturating_add(floors, c.floor);
      if (c.floor > 0) g.floor_holders.push_back(view_of(c));
    }
    g.granted = grantable_floor(bytes, total_, floors);
    floor_.store(g.granted, std::memory_order_relaxed);
    publish(j);
  });
  return g;
}

ShareStatus ShareClient::status() {
  ShareStatus s;
  s.floor = floor();
  s.ceiling = ceiling_.load(std::memory_order_relaxed);
  s.borrowed = borrowed(host_.reserved(), s.floor);
  const std::vector<SlotCopy> copies = forked() ? std::vector<SlotCopy>{} : others(joined());
  s.floor_short = shortfall(s.floor, unaccounted_.load(std::memory_order_relaxed), tally_of(copies));
  s.asks_made = asks_made_.load(std::memory_order_relaxed);
  s.asks_served = asks_served_.load(std::memory_order_acquire);  // before given_back_ (follow_now)
  s.given_back = given_back_.load(std::memory_order_relaxed);
  s.asks_timed_out = asks_timed_out_.load(std::memory_order_relaxed);
  {
    const std::lock_guard<std::mutex> guard(problem_mutex_);
    s.problem = problem_;
  }
  for (const SlotCopy& c : copies) s.others.push_back(view_of(c));
  return s;
}

// The members of the table by pid, then the processes the driver lists that are not members
// (native PyTorch, another user's or another table's): those could not be asked, and are named
// with what they hold. Where the driver lists none, what no member accounts for is one figure.
std::string ShareClient::describe(const std::vector<ProcessUse>& on_device) const noexcept {
  try {
    if (forked()) return "";
    const Joined j = joined();
    const std::size_t ceiling = ceiling_.load();
    std::string text = " Sharing the GPU (" + path_ + "): " +
                       (ceiling == SIZE_MAX ? std::string("no floor of the others limits this process;")
                                            : "the others' floors and live tensors leave this process " +
                                                  format_bytes(ceiling) + ";");
    std::vector<std::uint32_t> members{pid_};
    const std::vector<SlotCopy> copies = others(j);
    for (const SlotCopy& o : copies) {
      members.push_back(o.pid);
      text += " " + pid_text(o) + " reserves " + format_bytes(o.reserved) + " (" + format_bytes(o.in_use) +
              " in use, floor " + format_bytes(o.floor) + ", asked);";
    }
    if (copies.empty()) text += " no other gpumem process;";
    std::string not_asked;
    for (const ProcessUse& p : on_device) {
      if (std::find(members.begin(), members.end(), p.pid) != members.end()) continue;
      not_asked += " pid " + std::to_string(p.pid) + " holds " + format_bytes(p.bytes) + ";";
    }
    if (!not_asked.empty()) {
      text += " not in this table, so not asked (native PyTorch, other users' or other tables' processes, as the "
              "driver lists them):" + not_asked;
    }
    text += " " + format_bytes(unaccounted_.load()) +
            " is held outside every gpumem process of this table (CUDA contexts, native PyTorch or other users' "
            "processes: these could not be asked).";
    return text;
  } catch (...) {
    return "";
  }
}

}  // namespace gpumem
