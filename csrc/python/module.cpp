// gpumem._C: the compiled layer under the gpumem Python package.
//
//   - the limit grammar (parse_limit, parse_limit_assignments, limit_forms, format_bytes);
//   - the process's allocator over CUDA (install, set_limit, set_growable, stats, ...): every
//     function works before install(); a device's allocator is made on first use, so a limit or
//     segment kind set early holds from torch's first CUDA allocation on. install() and
//     is_installed() touch no CUDA; device_count() starts the driver; the rest need a device;
//   - SimAllocator: the same core over a simulated device, for tests and trace replay (no GPU);
//     with page_size > 0 the device maps pages, and growable segments are in use by default;
//   - sharing a GPU with other processes (share_join, share_set_floor, share_grant_floor,
//     share_status, share_leave_all), on both: joins the table at a path the package chose, in a
//     directory it trusts (docs/design.md); share_table_layout for the tests that forge a table;
//   - what monitoring reads, on both (existing_devices, device_figures, watch_pressure,
//     pressure_crossings): nothing of it counts the devices, makes an allocator or starts CUDA.
// Errors: LimitSpecError -> _C.LimitSpecError (a ValueError with the error's parts); DeviceError
// -> ValueError; gpumem's OutOfMemoryError -> _C.OutOfMemoryError (a MemoryError); install() too
// late -> RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backends/sim_backend.h"
#include "core/api.h"
#include "sharing/member.h"
#include "torch/install.h"
#include "torch/startup.h"

namespace py = pybind11;

namespace gpumem {
namespace {

py::dict stats_dict(const DeviceStats& stats) {
  py::dict out;
  for (const auto& [key, value] : flatten(stats)) out[py::str(key)] = value;
  return out;
}

DeviceStats stats_of(CachingAllocator& core, int device) {
  const DeviceAllocator* d = core.existing(device);
  return d ? d->stats() : DeviceStats{};
}

// Regions' pools: ids no torch pool takes (graphs' are {capture id, 0}, MemPools' {0, uid}).
constexpr std::uint64_t kRegionPools = std::uint64_t{1} << 62;
PoolId region_id(std::uint64_t serial) { return PoolId{kRegionPools, serial}; }

const char* state_name(BlockInfo::State state) {
  switch (state) {
    case BlockInfo::kFree: return "free";
    case BlockInfo::kAllocated: return "allocated";
    case BlockInfo::kPendingFree: return "pending_free";
  }
  return "unknown";
}

py::list snapshot_list(const DeviceAllocator& device) {
  py::list segments;
  for (const SegmentInfo& s : device.snapshot()) {
    py::list blocks;
    for (const BlockInfo& b : s.blocks) {
      blocks.append(py::dict(py::arg("address") = b.addr, py::arg("size") = b.size, py::arg("requested") = b.requested,
                             py::arg("state") = state_name(b.state)));
    }
    // "is_expandable" as in torch's snapshot: one entry per mapped stretch of a growable segment.
    segments.append(py::dict(py::arg("address") = s.addr, py::arg("size") = s.size, py::arg("stream") = s.stream,
                             py::arg("pool") = py::make_tuple(s.pool.first, s.pool.second),
                             py::arg("small") = s.small, py::arg("is_expandable") = s.growable,
                             py::arg("paused") = s.paused, py::arg("blocks") = blocks));
  }
  return segments;
}

// A scope as Python names it (python/gpumem/settings/scope.py checks it first, naming the forms).
LimitScope scope_of(const std::string& name) {
  if (name == limit_scope_name(LimitScope::kAllocator)) return LimitScope::kAllocator;
  if (name == limit_scope_name(LimitScope::kProcess)) return LimitScope::kProcess;
  throw LimitSpecError({"limit scope", name, "it is not a scope", "\"allocator\" or \"process\"", ""});
}

void set_limit_bytes(DeviceAllocator& device, std::optional<std::size_t> nbytes) { device.set_limit(nbytes); }

// ---- what monitoring reads (python/gpumem/monitoring/metrics.py, pressure.py) ----
// Counts no devices and makes no allocator: a device nobody used is not listed, so monitoring
// never starts CUDA.

py::list existing_device_list(const CachingAllocator& core) {
  py::list out;
  for (const DeviceAllocator* d : core.existing_devices()) out.append(d->device());
  return out;
}

// One device's figures for a scrape: reserved and the limit lock-free, one copy of the statistics
// (the lock held only for the copy), the device's own free and total where it can say (None if
// asking fails, or when not `device_memory`: the publisher makes no CUDA call). The GIL is released
// while they are read.
// Reserved is the statistics' (reserved_bytes.all.current, read with its peak), what memory_stats,
// the report and the timeline show too; "counted" and "counted_peak" are the cap's, what the limit
// measures (python/gpumem/monitoring/figures.py: Note [which reserved]).
py::dict device_figures(DeviceAllocator& device, bool device_memory) {
  std::size_t reserved = 0, limit = 0, outside = 0, counted = 0, counted_peak = 0, paused = 0, paused_allocated = 0;
  OutsideSource source = OutsideSource::kNone;
  LimitScope scope = LimitScope::kAllocator;
  DeviceStats stats;
  std::optional<MemInfo> mem;
  {
    py::gil_scoped_release release;
    limit = device.limit();
    outside = device.cap().outside();
    counted = device.cap().counted();
    counted_peak = device.cap().counted_peak();
    source = device.outside_source();
    scope = device.settings().scope;
    stats = device.stats();
    paused = device.paused_bytes();
    paused_allocated = device.paused_allocated();
    reserved = static_cast<std::size_t>(stats.reserved_bytes[kAll].current);
    // Asking the driver makes a CUDA context on a device that has none (one set_limit configured
    // but the program never used): only a device that holds memory, and so has one, is asked.
    if (device_memory && reserved > 0) quietly([&] { mem = device.device_mem_info(); });
  }
  py::object free = mem ? py::cast(mem->free) : py::none();
  py::object total = mem ? py::cast(mem->total) : py::none();
  return py::dict(py::arg("reserved") = reserved, py::arg("counted") = counted, py::arg("counted_peak") = counted_peak,
                  py::arg("limit") = limit, py::arg("stats") = stats_dict(stats),
                  py::arg("device_free") = free, py::arg("device_total") = total,
                  py::arg("scope") = limit_scope_name(scope), py::arg("outside") = outside,
                  py::arg("outside_source") = outside_source_name(source), py::arg("paused") = paused,
                  py::arg("paused_allocated") = paused_allocated);
}

py::object share_status(CachingAllocator& core, int device);

py::dict figures_of(const CachingAllocator& core, int index, bool device_memory) {
  DeviceAllocator* d = core.existing(index);
  if (!d) throw DeviceError("gpumem: device " + std::to_string(index) + " has not been used yet: no figures");
  py::dict figures = device_figures(*d, device_memory);
  figures["sharing"] = share_status(const_cast<CachingAllocator&>(core), index);  // None where it does not share
  return figures;
}

// (device, share, crossings, reserved at the last crossing, limit) per watched share per device.
py::list pressure_list(const CachingAllocator& core) {
  py::list out;
  for (const DeviceAllocator* d : core.existing_devices()) {
    d->cap().pressure().for_each([&](const PressureCount& c) {
      out.append(py::make_tuple(d->device(), c.share, c.crossings, c.reserved_at_crossing, d->limit()));
    });
  }
  return out;
}

// The backend, mapping pages of `page_size` bytes if that is not 0. Decided before the core
// exists: each device's allocator reads the page size once, when it is made.
SimBackend& with_pages(SimBackend& backend, std::size_t page_size) {
  if (page_size > 0) backend.enable_virtual_memory(page_size);
  return backend;
}

// The core over a simulated device, by address as Python sees it.
void leave_sharing(CachingAllocator& core);  // below, with the members of shared tables

class SimAllocator {
 public:
  SimAllocator(std::size_t capacity, int devices, std::size_t page_size)
      : backend_(capacity, devices), core_(with_pages(backend_, page_size)) {}
  ~SimAllocator() { leave_sharing(core_); }  // no responder may outlive its device
  SimAllocator(const SimAllocator&) = delete;
  SimAllocator& operator=(const SimAllocator&) = delete;

  std::uintptr_t malloc(int device, std::size_t size, StreamId stream) {
    return reinterpret_cast<std::uintptr_t>(core_.raw_alloc(device, size, stream));
  }
  void free(std::uintptr_t addr) { core_.raw_free(reinterpret_cast<void*>(addr)); }
  // As the torch adapter allocates while caching is off (torch.cuda.caching_allocator_enable(False)).
  std::uintptr_t malloc_uncached(int device, std::size_t size) {
    return reinterpret_cast<std::uintptr_t>(core_.device(device).malloc_uncached(size));
  }
  void free_uncached(int device, std::uintptr_t addr) {
    if (!core_.device(device).free_uncached(reinterpret_cast<void*>(addr))) {
      throw std::invalid_argument("gpumem: free_uncached of an address malloc_uncached did not return");
    }
  }
  void record_stream(std::uintptr_t addr, StreamId stream) {
    if (!core_.raw_record_stream(reinterpret_cast<void*>(addr), stream)) {
      throw std::invalid_argument("gpumem: record_stream of an address malloc did not return");
    }
  }
  DeviceAllocator& device(int index) { return core_.device(index); }
  CachingAllocator& core() { return core_; }
  SimBackend& backend() { return backend_; }

  py::dict ledger(int device) const {
    const SimBackend::Ledger l = backend_.ledger(device);
    return py::dict(py::arg("in_use") = l.in_use, py::arg("peak") = l.peak, py::arg("reserves") = l.reserves,
                    py::arg("releases") = l.releases, py::arg("refusals") = l.refusals, py::arg("syncs") = l.syncs,
                    py::arg("live_events") = l.live_events, py::arg("mapped") = l.mapped, py::arg("maps") = l.maps,
                    py::arg("unmaps") = l.unmaps, py::arg("address_ranges") = l.address_ranges);
  }

 private:
  SimBackend backend_;
  CachingAllocator core_;
};

// _C.OutOfMemoryError carries the numbers behind the refusal as attributes, so that callers (the
// replay) read them rather than parse the message.
py::object oom_object(PyObject* type, const OutOfMemoryError& e) {
  const OomInfo& i = e.info();
  py::object error = py::reinterpret_borrow<py::object>(type)(e.what());
  error.attr("device") = i.device;
  error.attr("case") = oom_kind_name(i.kind);
  error.attr("requested") = i.requested;
  error.attr("allocated") = i.allocated;
  error.attr("reserved") = i.reserved;
  error.attr("limit") = i.limit;
  error.attr("device_free") = i.device_free;
  error.attr("device_total") = i.device_total;
  error.attr("largest_free_block") = i.largest_free_block;
  return error;
}

// _C.LimitSpecError carries the parts its message was made from (core/errors.h), so that the
// package words its own messages from them (python/gpumem/settings/limits.py) rather than parse this one.
py::object limit_spec_object(PyObject* type, const LimitSpecError& e) {
  py::object error = py::reinterpret_borrow<py::object>(type)(e.what());
  error.attr("setting") = e.setting();
  error.attr("spec") = e.spec() ? py::object(py::str(*e.spec())) : py::object(py::none());
  error.attr("reason") = e.reason();
  error.attr("forms") = e.forms();
  return error;
}

// Sets `type` with `make()`'s instance as the Python error; with the message alone if there is no
// memory for the attributes.
template <class Make>
void set_error(PyObject* type, const char* message, Make make) {
  try {
    const py::object instance = make();
    PyErr_SetObject(type, instance.ptr());
  } catch (const py::error_already_set&) {
    PyErr_SetString(type, message);
  }
}

// Held for the life of the process: the translator may run until the interpreter ends.
PyObject* oom_type = nullptr;
PyObject* limit_spec_type = nullptr;

void register_errors(py::module_& m) {
  oom_type = PyErr_NewExceptionWithDoc(
      "gpumem._C.OutOfMemoryError",
      "gpumem refused a request. Attributes: device, case ('over the limit', 'device full' or "
      "'fragmentation'), requested, allocated, reserved, limit, device_free, device_total and "
      "largest_free_block, in bytes.",
      PyExc_MemoryError, nullptr);
  if (!oom_type) throw py::error_already_set();
  m.attr("OutOfMemoryError") = py::reinterpret_borrow<py::object>(oom_type);
  // A ValueError, as it has always been, so callers that catch ValueError go on catching it.
  limit_spec_type = PyErr_NewExceptionWithDoc(
      "gpumem._C.LimitSpecError",
      "A setting's value that gpumem refused (a ValueError). Attributes: setting (what the value was for), "
      "spec (the value as given, or None), reason (why, alone) and forms (the accepted forms, or '').",
      PyExc_ValueError, nullptr);
  if (!limit_spec_type) throw py::error_already_set();
  m.attr("LimitSpecError") = py::reinterpret_borrow<py::object>(limit_spec_type);
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const OutOfMemoryError& e) {
      set_error(oom_type, e.what(), [&] { return oom_object(oom_type, e); });
    } catch (const LimitSpecError& e) {
      set_error(limit_spec_type, e.what(), [&] { return limit_spec_object(limit_spec_type, e); });
    } catch (const DeviceError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
}

void bind_limits(py::module_& m) {
  m.attr("limit_forms") = kLimitForms;
  m.attr("SHOWN_LENGTH") = kShownBytes;  // python/gpumem/settings/echo.py cuts the user's text after as many
  m.attr("PRESSURE_REARM_GAP") = kPressureRearmGap;
  m.attr("MAX_PRESSURE_SHARES") = kMaxPressureWatches;
  m.attr("MAX_CHUNK") = kMaxLargeChunk;  // python/gpumem/settings/chunk.py: the largest GPUMEM_CHUNK
  m.def("parse_limit", &parse_limit, py::arg("spec"), py::arg("device_total"),
        "Bytes for a limit spec on a device of device_total bytes; None for \"none\". ValueError if bad.");
  m.def("parse_limit_assignments", [](const std::string& text) {
    std::vector<std::pair<int, std::string>> out;
    for (const LimitAssignment& a : parse_limit_assignments(text)) out.emplace_back(a.device, a.spec);
    return out;
  }, py::arg("text"), "GPUMEM_LIMIT's entries as (device, spec); device -1 means every device.");
  m.def("format_bytes", &format_bytes, py::arg("n"));
  m.def("block_size", [](std::size_t requested) { return round_size(requested); }, py::arg("requested"),
        "The block a request of `requested` bytes takes (core/sizing.h): at least 512 bytes, a multiple of 512.");
  m.def("resolve_limit_text", &resolve_limit_text, py::arg("text"), py::arg("totals"),
        "GPUMEM_LIMIT's bytes for devices of these totals (None: no limit), as applied at first use; "
        "ValueError naming GPUMEM_LIMIT if it does not fit them.");
}

// The members of shared GPUs' tables, by allocator and device: made by share_join, gone at
// share_leave_all (the package's atexit), never in a static destructor (CUDA may be gone by then).
// A forked child's copies are not its members (Note [a forked child is not a member],
// sharing/table.cpp): it leaves nothing, and never destroys them.
class Sharing {
 public:
  static Sharing& get() {
    static Sharing* sharing = new Sharing;  // never destroyed: see above
    return *sharing;
  }
  void join(CachingAllocator& core, int device, const std::string& path) {
    const std::lock_guard<std::mutex> guard(mutex_);
    forget_if_forked();
    if (members_.count({&core, device})) return;
    DeviceAllocator& alloc = core.device(device);
    auto member = std::make_shared<Member>(alloc);
    member->client = std::make_unique<ShareClient>(path, member->host, alloc.device_total());
    member->client->start();
    alloc.set_share(member->client.get());
    members_[{&core, device}] = std::move(member);
  }
  // The member, kept alive while the caller uses it (a leave meanwhile unmakes it after).
  std::shared_ptr<ShareClient> find(CachingAllocator& core, int device) {
    const std::lock_guard<std::mutex> guard(mutex_);
    forget_if_forked();
    auto it = members_.find({&core, device});
    if (it == members_.end()) return nullptr;
    return std::shared_ptr<ShareClient>(it->second, it->second->client.get());
  }
  void leave_all(CachingAllocator* only = nullptr) {
    std::vector<std::shared_ptr<Member>> leaving;
    {
      const std::lock_guard<std::mutex> guard(mutex_);
      forget_if_forked();
      for (auto it = members_.begin(); it != members_.end();) {
        if (only && it->first.first != only) {
          ++it;
          continue;
        }
        leaving.push_back(std::move(it->second));
        it = members_.erase(it);
      }
    }
    // With no lock of this registry held: unsetting the hooks waits for asks in flight.
    for (const auto& member : leaving) member->alloc.set_share(nullptr);
  }  // the members go here, or with the last caller still using one: responders stopped, slots freed

 private:
  struct Member {
    explicit Member(DeviceAllocator& a) : alloc(a), host(a) {}
    DeviceAllocator& alloc;
    DeviceHost host;
    std::unique_ptr<ShareClient> client;
  };
  // In a forked child: the parent's members are let go of, never unmade (their threads are not
  // here), and the child's allocators stop asking through them.
  void forget_if_forked() {
    const int now = static_cast<int>(::getpid());
    if (now == process_) return;
    static auto* kept = new std::vector<std::shared_ptr<Member>>;  // never destroyed
    for (auto& [key, member] : members_) {
      member->alloc.set_share(nullptr);
      kept->push_back(std::move(member));
    }
    members_.clear();
    process_ = now;
  }
  std::mutex mutex_;
  int process_ = static_cast<int>(::getpid());
  std::map<std::pair<const CachingAllocator*, int>, std::shared_ptr<Member>> members_;
};

void leave_sharing(CachingAllocator& core) { Sharing::get().leave_all(&core); }

std::shared_ptr<ShareClient> member_of(CachingAllocator& core, int device) {
  std::shared_ptr<ShareClient> client = Sharing::get().find(core, device);
  if (!client) throw std::invalid_argument("gpumem: device " + std::to_string(device) + " does not share its GPU: join first");
  return client;
}

py::dict member_view(const ShareMemberView& o) {
  return py::dict(py::arg("pid") = o.pid, py::arg("same_pid_namespace") = o.same_pid_namespace,
                  py::arg("floor") = o.floor, py::arg("reserved") = o.reserved, py::arg("in_use") = o.in_use);
}

py::object share_status(CachingAllocator& core, int device) {
  const std::shared_ptr<ShareClient> client = Sharing::get().find(core, device);
  if (!client) return py::none();
  const ShareStatus s = client->status();
  py::list others;
  for (const ShareMemberView& o : s.others) others.append(member_view(o));
  return py::dict(py::arg("table") = client->table_path(), py::arg("floor") = s.floor,
                  py::arg("ceiling") = s.ceiling == SIZE_MAX ? py::object(py::none()) : py::int_(s.ceiling),
                  py::arg("borrowed") = s.borrowed, py::arg("floor_short") = s.floor_short,
                  py::arg("asks_made") = s.asks_made, py::arg("asks_served") = s.asks_served,
                  py::arg("given_back") = s.given_back, py::arg("asks_timed_out") = s.asks_timed_out,
                  py::arg("problem") = s.problem.empty() ? py::object(py::none()) : py::str(s.problem),
                  py::arg("others") = others);
}

FloorGrant grant_floor(CachingAllocator& core, int device, std::size_t bytes) {
  const std::shared_ptr<ShareClient> client = member_of(core, device);
  const py::gil_scoped_release release;
  return client->set_floor(bytes);
}

py::dict grant_dict(const FloorGrant& g) {
  py::list holders;
  for (const ShareMemberView& o : g.floor_holders) holders.append(member_view(o));
  return py::dict(py::arg("asked") = g.asked, py::arg("granted") = g.granted, py::arg("short") = g.short_now,
                  py::arg("floor_holders") = holders);
}

// What a floor asked for is short of now: what the others' floors left out of the grant, and what
// their live tensors hold of it.
std::size_t floor_shortfall(const FloorGrant& g) { return (g.asked - g.granted) + g.short_now; }

py::dict table_layout() {
  const ShareLayout layout = share_layout();
  py::dict fields;
  for (const auto& [name, offset] : layout.fields) fields[py::str(name)] = offset;
  return py::dict(py::arg("header_bytes") = layout.header_bytes, py::arg("slot_bytes") = layout.slot_bytes,
                  py::arg("slots") = layout.slots, py::arg("fields") = fields);
}

template <class Module, class Core>
void bind_sharing(Module& m, Core core) {
  using Release = py::call_guard<py::gil_scoped_release>;
  m.def("share_join", [core](int device, const std::string& path) { Sharing::get().join(core(), device, path); },
        py::arg("device"), py::arg("path"), Release(),
        "Joins the shared table at `path` for `device` (once; again does nothing). RuntimeError saying why a table "
        "cannot be trusted or opened.");
  m.def("share_set_floor", [core](int device, std::size_t bytes) { return floor_shortfall(grant_floor(core(), device, bytes)); },
        py::arg("device"), py::arg("bytes"),
        "Sets the device's floor; returns how much of it cannot be honoured now (0: all of it).");
  m.def("share_grant_floor", [core](int device, std::size_t bytes) { return grant_dict(grant_floor(core(), device, bytes)); },
        py::arg("device"), py::arg("bytes"),
        "Sets the device's floor: {asked, granted (less where the others' floors leave less), short (of granted, "
        "what the others' live tensors hold now), floor_holders (pid, floor, ... of the others with one)}.");
  m.def("share_status", [core](int device) { return share_status(core(), device); }, py::arg("device"),
        "The device's sharing figures (floor, ceiling, borrowed, floor_short, asks_made, asks_served, given_back, "
        "others), or None where it does not share.");
  m.def("share_table_layout", &table_layout, "The shared table's layout: header_bytes, slot_bytes, slots, fields "
        "(name: offset in a slot), for tests that write a table as another process could.");
  m.def("share_leave_all", [core] { Sharing::get().leave_all(&core()); }, Release(),
        "Leaves every table: stops the responders and frees the slots.");
}

void bind_process_allocator(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  auto core = []() -> CachingAllocator& { return process_allocator().core(); };
  m.def("install", [](std::optional<std::string> limits, std::optional<bool> growable,
                       std::optional<std::string> scope, std::optional<std::size_t> chunk) {
    if (chunk) check_large_chunk(*chunk);
    install(StartupSettings{std::move(limits), growable, scope ? std::optional(scope_of(*scope)) : std::nullopt, chunk});
  }, py::arg("limits") = py::none(), py::arg("growable") = py::none(), py::arg("scope") = py::none(),
        py::arg("chunk") = py::none(),
        "Makes gpumem torch's CUDA allocator, touching no CUDA; GPUMEM_LIMIT's text, GPUMEM_SEGMENTS's kind, "
        "GPUMEM_SCOPE's scope and GPUMEM_CHUNK's bytes apply when the devices are first used. RuntimeError if "
        "torch's own allocator already served memory.");
  m.def("is_installed", &is_installed);
  m.def("device_count", [core] { return core().device_count(); });
  m.def("set_limit", [core](int device, const std::string& spec) { core().device(device).set_limit(std::string_view(spec)); },
        py::arg("device"), py::arg("spec"), Release());
  m.def("set_limit_bytes", [core](int device, std::optional<std::size_t> nbytes) { set_limit_bytes(core().device(device), nbytes); },
        py::arg("device"), py::arg("nbytes"), Release());
  m.def("get_limit", [core](int device) { return core().device(device).limit(); }, py::arg("device"));
  m.def("set_scope", [core](int device, const std::string& scope) { core().device(device).set_scope(scope_of(scope)); },
        py::arg("device"), py::arg("scope"), Release());
  m.def("get_scope", [core](int device) { return limit_scope_name(core().device(device).settings().scope); },
        py::arg("device"));
  m.def("outside", [core](int device) { return core().device(device).cap().outside(); }, py::arg("device"),
        "Under a limit on the whole process: its memory on the device outside gpumem, as last measured.");
  m.def("outside_source", [core](int device) { return outside_source_name(core().device(device).outside_source()); },
        py::arg("device"), "Where outside() was measured from: \"process accounting\", \"device at first use\" or \"none\".");
  m.def("set_release_threshold", [core](int device, double share) { core().device(device).set_release_threshold(share); },
        py::arg("device"), py::arg("share"));
  m.def("get_release_threshold", [core](int device) { return core().device(device).settings().release_threshold; },
        py::arg("device"));
  m.def("set_growable", [core](int device, bool on) { core().device(device).set_growable(on); },
        py::arg("device"), py::arg("on"), "Growable segments for new memory, or plain ones.");
  m.def("get_growable", [core](int device) { return core().device(device).settings().growable; }, py::arg("device"),
        "Whether growable segments are in effect: asked for, and the device can map pages.");
  m.def("set_large_chunk", [core](int device, std::size_t bytes) { core().device(device).set_large_chunk(bytes); },
        py::arg("device"), py::arg("bytes"), "The least chunk the large pool's new growable memory is mapped in.");
  m.def("get_large_chunk", [core](int device) { return core().device(device).settings().chunk; }, py::arg("device"),
        "The chunk the large pool's requests under 128 of them are mapped in; 0 where pages cannot be mapped.");
  m.def("growable_supported", [core](int device) { return core().device(device).page_size() > 0; },
        py::arg("device"), "Whether the device can map pages (CUDA virtual memory management).");
  m.def("page_size", [core](int device) { return core().device(device).page_size(); }, py::arg("device"),
        "The device's mapping granularity in bytes; 0 where it cannot map pages.");
  m.def("empty_cache", [core] {
    for (int d = 0; d < core().device_count(); ++d) {
      if (DeviceAllocator* device = core().existing(d)) device->empty_cache();
    }
  }, Release());
  m.def("stats", [core](int device) { return stats_dict(stats_of(core(), device)); }, py::arg("device"));
  m.def("reset_peak_stats", [core](int device) {
    if (DeviceAllocator* d = core().existing(device)) d->reset_peak_stats();
  }, py::arg("device"));
  m.def("reset_accumulated_stats", [core](int device) {
    if (DeviceAllocator* d = core().existing(device)) d->reset_accumulated_stats();
  }, py::arg("device"));
  m.def("mem_info", [core](int device) {
    const MemInfo info = core().device(device).device_mem_info();
    return std::make_pair(info.free, info.total);
  }, py::arg("device"), "(free, total) bytes of the device itself, as CUDA reports them.");
  m.def("capped_mem_info", [](int device, std::size_t free, std::size_t total) {
    return process_allocator().capped_view(static_cast<c10::DeviceIndex>(device), MemInfo{free, total});
  }, py::arg("device"), py::arg("free"), py::arg("total"),
        "(free, total) under the cap from the device's own: total is the limit, free what could still be reserved.",
        Release());
  m.def("apply_changed_torch_settings", [core](const std::string& text, bool keep_segments, bool keep_threshold) {
    apply_changed_torch_settings(core(), text, keep_segments, keep_threshold);
  }, py::arg("text"), py::arg("keep_segments"), py::arg("keep_threshold"),
        "What torch's settings, just changed to `text`, ask of gpumem's devices now.");
  m.def("device_total", [core](int device) { return core().backend().total_memory(device); }, py::arg("device"),
        "The device's memory in bytes; makes no allocator and no CUDA context.");
  m.def("largest_free_block", [core](int device) {
    const DeviceAllocator* d = core().existing(device);
    return d ? d->largest_free_block() : std::size_t{0};
  }, py::arg("device"));
  // Regions (core/pause.cpp): a region's pool is {kRegionPools, serial}, the serial the package's.
  m.def("region_create", [core](int device, std::uint64_t serial) { core().device(device).create_region(region_id(serial)); },
        py::arg("device"), py::arg("serial"),
        "Makes region `serial` on the device (growable segments wherever pages can be mapped); ValueError where "
        "they cannot or it exists.");
  m.def("region_begin", [core](int device, std::uint64_t serial) {
    core().device(device).begin_allocate_to_pool(region_id(serial), [thread = std::this_thread::get_id()](StreamId) {
      return std::this_thread::get_id() == thread;
    });
  }, py::arg("device"), py::arg("serial"), "The calling thread's allocations on the device come from the region until region_end.");
  m.def("region_end", [core](int device, std::uint64_t serial) { core().device(device).end_allocate_to_pool(region_id(serial)); },
        py::arg("device"), py::arg("serial"));
  m.def("region_pause", [core](int device, std::uint64_t serial, bool backup) {
    return core().device(device).pause(region_id(serial), backup);
  }, py::arg("device"), py::arg("serial"), py::arg("backup"), Release(),
        "Pauses the region: the bytes it unmapped (0 if paused already).");
  m.def("region_resume", [core](int device, std::uint64_t serial) { return core().device(device).resume(region_id(serial)); },
        py::arg("device"), py::arg("serial"), Release(),
        "Resumes the region: the bytes mapped again (0 if not paused); OutOfMemoryError where they do not fit.");
  m.def("region_drop_backup", [core](int device, std::uint64_t serial) { return core().device(device).drop_backup(region_id(serial)); },
        py::arg("device"), py::arg("serial"), Release(),
        "Frees the host copy a resumed region kept for its next pause: its bytes (0 if none, or paused).");
  m.def("region_prepare_backup", [core](int device, std::uint64_t serial) {
    return core().device(device).prepare_backup(region_id(serial));
  }, py::arg("device"), py::arg("serial"), Release(),
        "Pins host memory for the region's next pause now: the bytes pinned (0 if it holds enough, or is paused).");
  m.def("paused_bytes", [core](int device) {
    const DeviceAllocator* d = core().existing(device);
    return py::make_tuple(d ? d->paused_bytes() : 0, d ? d->paused_allocated() : 0);
  }, py::arg("device"), "(bytes paused regions gave back, their live blocks' bytes) on the device.");
  m.def("existing_devices", [core] { return existing_device_list(core()); },
        "The devices in use (their allocator made), without counting devices or starting CUDA.");
  m.def("device_figures", [core](int device, bool device_memory) { return figures_of(core(), device, device_memory); },
        py::arg("device"), py::arg("device_memory") = true,
        "A device in use: reserved, counted, counted_peak, limit, stats, scope, outside, sharing, device_free and device_total (None "
        "where unknown, or not asked: device_memory=False).");
  m.def("watch_pressure", [core](double share) { core().watch_pressure(share); }, py::arg("share"),
        "Counts crossings of `share` of the limit on every device, those used later too.");
  m.def("pressure_crossings", [core] { return pressure_list(core()); },
        "(device, share, crossings, reserved at the last crossing, limit) per watched share, per device in use.");
  bind_sharing(m, core);
}

void bind_sim_allocator(py::module_& m) {
  m.attr("SIM_MAX_CAPACITY") = SimBackend::kMaxCapacity;
  m.attr("SIM_MAX_DEVICES") = SimBackend::kMaxDevices;
  py::class_<SimAllocator>(m, "SimAllocator", "gpumem's allocator over a simulated device: no GPU, no memory touched.")
      .def(py::init<std::size_t, int, std::size_t>(), py::arg("capacity"), py::arg("devices") = 1, py::kw_only(),
           py::arg("page_size") = 0)
      .def("malloc", &SimAllocator::malloc, py::arg("device"), py::arg("size"), py::arg("stream") = 0)
      .def("share_join", [](SimAllocator& s, int device, const std::string& path) { Sharing::get().join(s.core(), device, path); },
           py::arg("device"), py::arg("path"), py::call_guard<py::gil_scoped_release>())
      .def("share_grant_floor", [](SimAllocator& s, int device, std::size_t bytes) { return grant_dict(grant_floor(s.core(), device, bytes)); },
           py::arg("device"), py::arg("bytes"))
      .def("share_set_floor", [](SimAllocator& s, int device, std::size_t bytes) { return floor_shortfall(grant_floor(s.core(), device, bytes)); },
           py::arg("device"), py::arg("bytes"))
      .def("share_status", [](SimAllocator& s, int device) { return share_status(s.core(), device); }, py::arg("device"))
      .def("share_leave", [](SimAllocator& s) { leave_sharing(s.core()); }, py::call_guard<py::gil_scoped_release>())
      .def("free", &SimAllocator::free, py::arg("addr"))
      .def("region_create", [](SimAllocator& s, int device, std::uint64_t serial) { s.device(device).create_region(region_id(serial)); },
           py::arg("device"), py::arg("serial"))
      .def("region_begin", [](SimAllocator& s, int device, std::uint64_t serial) {
        s.device(device).begin_allocate_to_pool(region_id(serial), [](StreamId) { return true; });
      }, py::arg("device"), py::arg("serial"), "Every allocation on the device comes from the region until region_end.")
      .def("region_end", [](SimAllocator& s, int device, std::uint64_t serial) { s.device(device).end_allocate_to_pool(region_id(serial)); },
           py::arg("device"), py::arg("serial"))
      .def("region_pause", [](SimAllocator& s, int device, std::uint64_t serial, bool backup) {
        return s.device(device).pause(region_id(serial), backup);
      }, py::arg("device"), py::arg("serial"), py::arg("backup"))
      .def("region_resume", [](SimAllocator& s, int device, std::uint64_t serial) { return s.device(device).resume(region_id(serial)); },
           py::arg("device"), py::arg("serial"))
      .def("region_drop_backup", [](SimAllocator& s, int device, std::uint64_t serial) {
        return s.device(device).drop_backup(region_id(serial));
      }, py::arg("device"), py::arg("serial"))
      .def("region_prepare_backup", [](SimAllocator& s, int device, std::uint64_t serial) {
        return s.device(device).prepare_backup(region_id(serial));
      }, py::arg("device"), py::arg("serial"))
      .def("malloc_uncached", &SimAllocator::malloc_uncached, py::arg("device"), py::arg("size"),
           "Memory of its own from the device, as while caching is off; free_uncached gives it back.")
      .def("free_uncached", &SimAllocator::free_uncached, py::arg("device"), py::arg("addr"))
      .def("record_stream", &SimAllocator::record_stream, py::arg("addr"), py::arg("stream"))
      .def("set_limit", [](SimAllocator& s, int device, const std::string& spec) { s.device(device).set_limit(std::string_view(spec)); },
           py::arg("device"), py::arg("spec"))
      .def("set_limit_bytes", [](SimAllocator& s, int device, std::optional<std::size_t> nbytes) { set_limit_bytes(s.device(device), nbytes); },
           py::arg("device"), py::arg("nbytes"))
      .def("get_limit", [](SimAllocator& s, int device) { return s.device(device).limit(); }, py::arg("device"))
      .def("set_scope", [](SimAllocator& s, int device, const std::string& scope) {
        s.device(device).set_scope(scope_of(scope));
      }, py::arg("device"), py::arg("scope"))
      .def("get_scope", [](SimAllocator& s, int device) { return limit_scope_name(s.device(device).settings().scope); },
           py::arg("device"))
      .def("outside", [](SimAllocator& s, int device) { return s.device(device).cap().outside(); }, py::arg("device"))
      .def("outside_source", [](SimAllocator& s, int device) {
        return outside_source_name(s.device(device).outside_source());
      }, py::arg("device"))
      .def("set_use_outside", [](SimAllocator& s, int device, std::size_t process, std::size_t others) {
        s.backend().set_use_outside(device, process, others);
      }, py::arg("device"), py::arg("process"), py::arg("others") = 0,
           "Memory on the simulated device outside the allocator: the process's (a library's) and other processes'.")
      .def("set_process_accounting", [](SimAllocator& s, bool on) { s.backend().set_process_accounting(on); },
           py::arg("on"), "Whether the simulated driver reports this process's memory (as NVML does for its pid).")
      .def("reserved", [](SimAllocator& s, int device) { return s.device(device).reserved(); }, py::arg("device"))
      .def("set_growable", [](SimAllocator& s, int device, bool on) { s.device(device).set_growable(on); },
           py::arg("device"), py::arg("on"))
      .def("growable", [](SimAllocator& s, int device) { return s.device(device).settings().growable; }, py::arg("device"))
      .def("set_large_chunk", [](SimAllocator& s, int device, std::size_t bytes) { s.device(device).set_large_chunk(bytes); },
           py::arg("device"), py::arg("bytes"))
      .def("large_chunk", [](SimAllocator& s, int device) { return s.device(device).settings().chunk; }, py::arg("device"))
      .def("stats", [](SimAllocator& s, int device) { return stats_dict(stats_of(s.core(), device)); }, py::arg("device"))
      .def("empty_cache", [](SimAllocator& s, int device) { s.device(device).empty_cache(); }, py::arg("device"))
      .def("reset_peak_stats", [](SimAllocator& s, int device) { s.device(device).reset_peak_stats(); }, py::arg("device"))
      .def("complete_events", [](SimAllocator& s) { s.backend().complete_events(); })
      .def("fail_next", [](SimAllocator& s, int count) { s.backend().fail_next(count); }, py::arg("n"))
      .def("ledger", &SimAllocator::ledger, py::arg("device"))
      .def("check_invariants", [](SimAllocator& s, int device) { s.device(device).check_invariants(); }, py::arg("device"))
      .def("snapshot", [](SimAllocator& s, int device) { return snapshot_list(s.device(device)); }, py::arg("device"))
      .def("largest_free_block", [](SimAllocator& s, int device) { return s.device(device).largest_free_block(); },
           py::arg("device"))
      .def("existing_devices", [](SimAllocator& s) { return existing_device_list(s.core()); })
      .def("device_figures", [](SimAllocator& s, int device, bool device_memory) { return figures_of(s.core(), device, device_memory); },
           py::arg("device"), py::arg("device_memory") = true)
      .def("watch_pressure", [](SimAllocator& s, double share) { s.core().watch_pressure(share); }, py::arg("share"))
      .def("pressure_crossings", [](SimAllocator& s) { return pressure_list(s.core()); });
}

}  // namespace
}  // namespace gpumem

PYBIND11_MODULE(_C, m) {
  py::module_::import("torch");  // torch's libraries and its CUDA state first
  m.doc() = "gpumem's compiled layer: the limit grammar, torch's CUDA allocator under a cap, a simulated device.";
  gpumem::register_errors(m);
  gpumem::bind_limits(m);
  gpumem::bind_process_allocator(m);
  gpumem::bind_sim_allocator(m);
}
