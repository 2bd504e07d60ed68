// Regions, paused and resumed: a process parks the memory of live tensors and gets it back at the
// same addresses.
//
// Design note. A region (gpumem.region) is a private pool whose requests come from it while its
// target is active, as a MemPool's do, but whose segments are growable even where the process's
// default is plain: pausing unmaps physical memory under a fixed address range and resuming maps
// it there again, which plain segments (one cudaMalloc each) cannot do. So a region refuses where
// the backend cannot map pages, and its growths never fall back to plain segments.
//
// pause() waits for the device's queued work (nothing may read a chunk once it is unmapped), gives
// back the region's free cache as a release does (its whole free chunks go), copies each run of
// the chunks left to host memory where a backup is asked for, and unmaps them: each growable
// segment's chunks move to Segment::paused and the cap and the statistics' reserved drop by their
// bytes. The blocks stay as they were: a tensor keeps its address, an allocated block stays
// allocated in the statistics, and a block freed meanwhile goes to the region's free set as
// usual. Nothing hands out or gives back a paused region's memory: malloc refuses a request
// whose target is a paused region, and releasable_pool() leaves it out of every release (its
// segments hold no chunk, so the growable release would find nothing anyway). What the cap
// measures requests against, allocated(), leaves out the paused regions' live bytes.
//
// resume() maps every paused chunk again (each run in chunks of its segment's size, one Backend::
// map call a run) under the cap, as a growth is: where the cap or the device refuses, the process's
// unused cache goes back and it tries once more; where that fails too, the runs mapped so far go
// back and the error names the paused bytes: the region stays paused and its tensors keep their
// backup. Where the device refused and other processes share the GPU, they are asked first, as for
// a request (DeviceAllocator::resume asks with no lock held and calls again). Then the backup is
// copied back, and kept: pinning host memory locks and maps every page of it, work a copy into
// memory pinned already does not do, so the next pause of the same chunks (an RL loop's every
// round) reuses it (benchmarks/bench_pause.py times the first pause and the later ones);
// prepare_backup pins that memory ahead, for every mapped chunk of the region, with no lock held
// while it pins; a pause copies each run into held memory that covers it whole, and frees held
// memory no run lies in; drop_backup or the allocator's end frees the rest. Blocks freed while
// paused come back as cached memory, which the next release gives back.
#include <algorithm>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/device_core.h"

namespace gpumem {

void DeviceCore::create_region(PoolId id) {
  if (sources_.growable.page_size() == 0) {
    throw std::invalid_argument("gpumem: a region needs growable segments, and this device cannot map pages (no CUDA "
                                "virtual memory management): its memory could not keep its addresses when paused");
  }
  d_.pools.create(id, nullptr);
  Pool& pool = d_.pools.existing(id);
  if (pool.use_count() != 1 || pool.region()) {
    d_.pools.drop_holder(id);
    throw std::invalid_argument("gpumem: that pool exists already; a region's pool is its own");
  }
  pool.make_region();
}

namespace {

// Where `c` goes among `held` (disjoint ranges, by address).
std::vector<HostCopy>::iterator place_of(std::vector<HostCopy>& held, const HostCopy& c) {
  return std::upper_bound(held.begin(), held.end(), c.device_addr,
                          [](std::uintptr_t addr, const HostCopy& h) { return addr < h.device_addr; });
}

// The held ranges `c` overlaps, [first, last).
std::pair<std::vector<HostCopy>::iterator, std::vector<HostCopy>::iterator> overlapping(std::vector<HostCopy>& held,
                                                                                        const HostCopy& c) {
  const std::uintptr_t end = c.device_addr + c.bytes;
  auto first = place_of(held, c);
  if (first != held.begin() && std::prev(first)->device_addr + std::prev(first)->bytes > c.device_addr) --first;
  const auto last = std::lower_bound(first, held.end(), end, [](const HostCopy& h, std::uintptr_t at) { return h.device_addr < at; });
  return {first, last};
}

}  // namespace

// The runs of adjacent mapped chunks of the region's segments, each a copy with no host memory yet.
std::vector<HostCopy> DeviceCore::mapped_runs(const Pool& pool) const {
  std::vector<HostCopy> runs;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->pool != &pool) continue;
    for_each_run(segment->chunks, segment->chunk,
                 [&](std::uintptr_t lo, std::uintptr_t hi) { runs.push_back({lo, hi - lo, nullptr, 0}); });
  }
  return runs;
}

// Points each run that lies whole inside host memory the region holds at it (host, offset), and
// frees the held memory that no run lies in (it backs up chunks unmapped since, and pinned host
// memory is too dear to keep for nothing) or that a run not inside it overlaps (that run gets
// memory of its own, and held ranges stay disjoint); the runs it held get memory of their own too.
void DeviceCore::cover(PoolId id, std::vector<HostCopy>& runs) {
  const auto found = backups_.find(id);
  if (found == backups_.end()) return;
  std::vector<HostCopy>& held = found->second.held;
  const auto index_of = [&](std::vector<HostCopy>::iterator it) { return static_cast<std::size_t>(it - held.begin()); };
  std::vector<std::size_t> holder(runs.size(), held.size());  // per run: the held range it lies in, if any
  std::vector<bool> used(held.size(), false);
  std::vector<bool> overlapped(held.size(), false);
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const HostCopy& run = runs[r];
    const auto [first, last] = overlapping(held, run);
    const bool inside = last - first == 1 && first->device_addr <= run.device_addr &&
                        run.device_addr + run.bytes <= first->device_addr + first->bytes;
    if (inside) {
      holder[r] = index_of(first);
      used[holder[r]] = true;
    } else {
      for (auto it = first; it != last; ++it) overlapped[index_of(it)] = true;
    }
  }
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const std::size_t h = holder[r];
    if (h == held.size() || overlapped[h]) continue;
    runs[r].host = held[h].host;
    runs[r].offset = runs[r].device_addr - held[h].device_addr;
  }
  std::vector<HostCopy> kept;
  std::vector<HostCopy> spare;
  for (std::size_t i = 0; i < held.size(); ++i) (used[i] && !overlapped[i] ? kept : spare).push_back(held[i]);
  d_.backend.drop_backup(d_.device, spare);
  held = std::move(kept);
}

std::size_t DeviceCore::drop_backup(PoolId id) {
  const Pool& pool = region_of(id);
  const auto kept = backups_.find(id);
  if (pool.paused() || kept == backups_.end()) return 0;
  std::size_t bytes = 0;
  for (const HostCopy& c : kept->second.held) bytes += c.bytes;
  d_.backend.drop_backup(d_.device, kept->second.held);
  backups_.erase(kept);
  return bytes;
}

std::vector<HostCopy> DeviceCore::backup_wanted(PoolId id) {
  const Pool& pool = region_of(id);
  if (pool.paused()) return {};
  std::vector<HostCopy> runs = mapped_runs(pool);
  cover(id, runs);
  runs.erase(std::remove_if(runs.begin(), runs.end(), [](const HostCopy& c) { return c.host != nullptr; }), runs.end());
  return runs;
}

std::size_t DeviceCore::keep_backup(PoolId id, std::vector<HostCopy>& copies) {
  const bool paused = region_of(id).paused();  // paused meanwhile: its pause made what it needs
  std::vector<HostCopy>& held = backups_[id].held;
  std::vector<HostCopy> spare;
  std::size_t kept = 0;
  for (const HostCopy& c : copies) {
    const auto [first, last] = overlapping(held, c);
    const bool taken = paused || first != last;
    if (taken) {
      spare.push_back(c);
    } else {
      held.insert(place_of(held, c), c);
      kept += c.bytes;
    }
  }
  d_.backend.drop_backup(d_.device, spare);
  return kept;
}

Pool& DeviceCore::region_of(PoolId id) const {
  Pool& pool = d_.pools.existing(id);
  if (!pool.region()) throw std::invalid_argument("gpumem: that pool is not a region");
  return pool;
}

std::size_t DeviceCore::live_bytes_of(const Pool& pool) const {
  std::size_t live = 0;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->pool != &pool) continue;
    for (const Block* b = segment->head; b; b = b->next) {
      if (b->allocated) live += b->size;  // not a block freed meanwhile, pending or not
    }
  }
  return live;
}

std::size_t DeviceCore::pause(PoolId id, bool backup) {
  Pool& pool = region_of(id);
  if (pool.paused()) return 0;
  if (d_.capturing()) {
    throw std::logic_error("gpumem: cannot pause a region while a pool is the allocation target (inside gpumem.region, "
                           "torch.cuda.use_mem_pool or a CUDA graph capture): pause after it ends");
  }
  d_.accounts.synced_all_streams();
  d_.backend.synchronize(d_.device);  // the streams' work on the region is done: nothing reads it once unmapped
  process_events();
  sources_.growable.unmap_cached_of(pool);
  std::vector<Segment*> segments;
  std::vector<HostCopy> copies;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->pool == &pool) segments.push_back(segment.get());
  }
  if (backup) {  // a copy for each run of adjacent chunks, into the host memory held where it covers the run
    copies = mapped_runs(pool);
    cover(id, copies);
    std::vector<std::size_t> fresh;
    for (std::size_t i = 0; i < copies.size(); ++i) {
      if (!copies[i].host) fresh.push_back(i);
    }
    d_.backend.back_up(d_.device, copies);  // throws having freed what it allocated: nothing paused yet
    std::vector<HostCopy>& held = backups_[id].held;
    for (std::size_t i : fresh) held.insert(place_of(held, copies[i]), copies[i]);
  }
  std::size_t bytes = 0;
  for (Segment* segment : segments) bytes += sources_.growable.pause(*segment);
  paused_allocated_ += live_bytes_of(pool);
  paused_bytes_ += bytes;
  pool.set_paused(true);
  if (backup) backups_[id].copied = std::move(copies);
  debug_check();
  return bytes;
}

std::optional<std::size_t> DeviceCore::resume(PoolId id, Asking& asking) {
  Pool& pool = region_of(id);
  if (!pool.paused()) return 0;
  if (d_.capturing()) {
    throw std::logic_error("gpumem: cannot resume a region while a pool is the allocation target (inside gpumem.region, "
                           "torch.cuda.use_mem_pool or a CUDA graph capture): resume after it ends");
  }
  std::vector<Segment*> segments;
  std::size_t bytes = 0;
  for (const auto& [addr, segment] : d_.segments) {
    if (segment->pool != &pool) continue;
    segments.push_back(segment.get());
    bytes += segment->paused.size() * segment->chunk;
  }
  // Every segment mapped again, or none (those mapped go back); false where the cap or the device
  // refused, `device_refused` saying which.
  bool device_refused = false;
  const auto map_all = [&] {
    device_refused = false;
    for (std::size_t i = 0; i < segments.size(); ++i) {
      bool mapped = false;
      try {
        mapped = sources_.growable.resume(*segments[i], device_refused);
      } catch (...) {
        for (std::size_t j = 0; j < i; ++j) sources_.growable.pause(*segments[j]);
        throw;
      }
      if (!mapped) {
        for (std::size_t j = 0; j < i; ++j) sources_.growable.pause(*segments[j]);
        return false;
      }
    }
    return true;
  };
  // As a request's growth: where the cap or the device refuses, the process's cache goes first.
  measure_outside();
  if (!map_all()) {
    synchronize_and_process_events();
    release_.all_unused();
    d_.accounts.retried();
    if (!map_all()) {
      if (device_refused && hooks_to_ask(asking, {0, bytes})) return std::nullopt;  // the caller asks, calls again
      throw_oom(bytes, bytes, device_refused, bytes);
    }
  }
  const auto backup = backups_.find(id);
  if (backup != backups_.end() && !backup->second.copied.empty()) {
    try {
      d_.backend.restore(d_.device, backup->second.copied);
    } catch (...) {
      for (Segment* segment : segments) sources_.growable.pause(*segment);
      throw;
    }
    // The held memory stays: the next pause of the same chunks copies into it (pinning host memory
    // costs more than the copy).
    backup->second.copied.clear();
  }
  paused_allocated_ -= live_bytes_of(pool);
  paused_bytes_ -= bytes;
  pool.set_paused(false);
  debug_check();
  return bytes;
}

}  // namespace gpumem
