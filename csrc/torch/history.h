// The allocation history behind torch.cuda.memory._record_memory_history and _dump_snapshot.
//
// One bounded ring of torch TraceEntry per device (oldest overwritten first), plus the trace
// trackers torch attaches (attachAllocatorTraceTracker), which see every entry whether or not the
// ring records. Nothing here runs on the allocation path unless active() says so: one relaxed
// atomic load per allocate and free when history and trackers are off.
//
// Stacks, as native keeps them (torch's RecordContext levels, each including the one before):
//   STATE  the stack that allocated each live block and each segment, shown by snapshots;
//   ALLOC  also on the trace entries of allocations (and of frees, which carry the allocating
//          stack when no freeing stack was taken);
//   ALL    also the stack that freed, on free and segment-release entries.
// The adapter gathers a stack with gather(level) before it takes any allocator lock (the
// recorder takes the GIL), and hands it to record() and to the live tables below.
//
// Note [stacks kept after recording]
//   Turning recording off keeps the stacks of the blocks and segments that are live, as native
//   keeps them on its Blocks: a snapshot taken later still shows where each live block came from
//   (torch's cudagraph trees turn recording on for a warm-up run only and read the stacks of the
//   blocks it leaked afterwards, in check_memory_pool). A stack goes when its block is freed or
//   its segment given back. Until the last kept stack has gone, the history stays active(): the
//   allocation path reports frees and segment releases (no stack is gathered and no entry made),
//   so that a stack never outlives its block. Then the path is quiet again.
//
// Note [the requested size of a free block]
//   A native snapshot shows a free block with the size its Block was last asked for: a freed
//   Block absorbs its free neighbours and keeps its requested_size, so the free block a freed
//   tensor merges into shows that tensor's size (torch's test_memory_plots finds a freed
//   128x128 float tensor's 65536 there once filter_freed has dropped the trace's alloc and free
//   entries). gpumem's core keeps no requested size for free blocks. While recording, the
//   history notes each free's address and requested bytes, drops the notes of memory handed out
//   again or given back to the device, and a snapshot's free block shows the latest free noted
//   inside it, else 0. Unlike native, a free block whose head was handed out again loses the
//   note there, and without recording free blocks show 0. The notes lie in free memory, one per
//   address a block started at: no more than the blocks the device held.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "core/block.h"
#include "core/pool.h"
#include "torch/compat.h"

namespace gpumem {

class History {
 public:
  using Action = torch_compat::TorchTraceEntry::Action;
  using CreateContextFn = c10::cuda::CUDACachingAllocator::CreateContextFn;
  using RecordContext = c10::cuda::CUDACachingAllocator::RecordContext;
  using Tracker = c10::cuda::CUDACachingAllocator::AllocatorTraceTracker;
  using Context = std::shared_ptr<c10::GatheredContext>;

  explicit History(int devices);
  ~History();
  History(const History&) = delete;
  History& operator=(const History&) = delete;

  // Recording, tracking, or following kept stacks: the allocation path must report its events.
  bool active() const { return active_.load(std::memory_order_relaxed); }
  // True while some History in the process is active: the DataPtr deleter, a plain function with
  // no adapter at hand, checks this before looking for its adapter.
  static bool any_active() { return active_count_.load(std::memory_order_relaxed) > 0; }

  // recordHistory's arguments. Disabling drops the recorded entries, as native does, and keeps the
  // stacks of live blocks and segments (Note [stacks kept after recording]); `clear` drops the
  // entries while recording goes on. An unknown name in skip_actions is an error that changes
  // nothing.
  void configure(bool enabled, CreateContextFn recorder, std::size_t max_entries, RecordContext when, bool clear,
                 const std::vector<std::string>& skip_actions);
  bool enabled() const;
  void attach_tracker(Tracker tracker);
  // Stops recording and drops the trackers: the owner is shutting down, and what it releases
  // then is no event of the program's.
  void stop();

  // The calling thread's stack if recording keeps stacks at `level`, else nullptr. Runs the
  // recorder: never call it under an allocator lock.
  Context gather(RecordContext level) const;
  // An entry; it carries `context` if recording keeps stacks on entries (ALLOC and above).
  void record(Action action, int device, std::uintptr_t addr, std::size_t size, StreamId stream, PoolId pool,
              Context context = nullptr);

  // The stacks that allocated live blocks and segments, by device and address (STATE and above).
  enum Table { kBlocks, kSegments };
  void remember(Table table, int device, std::uintptr_t addr, Context context);
  Context forget(Table table, int device, std::uintptr_t addr);  // the stack, or nullptr
  Context context(Table table, int device, std::uintptr_t addr) const;

  // The requested sizes of freed blocks, while recording (Note [the requested size of a free block]).
  void note_free(int device, std::uintptr_t addr, std::size_t requested);
  void drop_frees(int device, std::uintptr_t addr, std::size_t size);  // handed out or given back
  // The requested bytes of the latest free noted in [addr, addr + size), 0 if none.
  std::size_t last_freed_within(int device, std::uintptr_t addr, std::size_t size) const;

  // Tags for the entries that follow: the innermost torch.compile region and the user's metadata.
  void push_compile_context(std::string name);
  void pop_compile_context();
  void set_user_metadata(std::string metadata);
  std::string user_metadata() const;

  // Entries per device, oldest first, times in microseconds since the epoch.
  // One list per device, for the first `devices` devices.
  std::vector<std::vector<torch_compat::TorchTraceEntry>> traces(int devices) const;

 private:
  struct Ring {
    std::vector<torch_compat::TorchTraceEntry> entries;
    std::size_t next = 0;  // where the next entry goes once the ring is full
  };
  using Key = std::pair<int, std::uintptr_t>;
  struct Freed {
    std::uint64_t order;  // later frees have higher numbers
    std::size_t requested;
  };
  static constexpr int kActions = static_cast<int>(Action::OOM) + 1;

  void set_active_locked(bool active);
  bool listened_locked() const;  // recording, tracking, or stacks kept: the path must report
  bool keeps(RecordContext level) const { return enabled_ && recorder_ && when_ >= level; }

  mutable std::mutex mutex_;
  std::atomic<bool> active_{false};
  bool enabled_ = false;
  CreateContextFn recorder_ = nullptr;
  RecordContext when_ = RecordContext::NEVER;
  std::size_t max_entries_ = 0;
  bool skip_[kActions] = {};
  std::vector<Ring> rings_;
  std::vector<Tracker> trackers_;
  std::map<Key, Context> contexts_[2];  // by Table
  std::map<Key, Freed> freed_;
  std::uint64_t frees_ = 0;
  std::string user_metadata_;
  std::vector<std::string> compile_contexts_;  // innermost last

  static std::atomic<int> active_count_;
};

}  // namespace gpumem
