#include "torch/allocator.h"

#include <algorithm>

#include "torch/error_bridge.h"

namespace gpumem {

namespace {

// Live adapters, for the deleter's slow path: usually one, the installed adapter (tests make more).
// Leaked on purpose: a DataPtr freed during static destruction must still find its list.
std::mutex& adapters_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::vector<TorchAllocator*>& adapters() {
  static auto* list = new std::vector<TorchAllocator*>;
  return *list;
}

bool in_private_pool(const Block* block) { return !CachingAllocator::pool_of(block).is_default(); }

// A DataPtr's context (see allocator.h): the Block* for the default pool; the address with tag 1
// for a private pool, with tag 2 for memory handed out while caching is off. Block objects are
// 8-byte aligned and device addresses 512-byte aligned, so the two low bits are free.
constexpr std::uintptr_t kTagBits = 3, kPoolTag = 1, kUncachedTag = 2;
std::uintptr_t tag_of(const void* ctx) { return reinterpret_cast<std::uintptr_t>(ctx) & kTagBits; }
void* address_context(const Block* block) { return reinterpret_cast<void*>(block->addr | kPoolTag); }
std::uintptr_t address_in(const void* ctx) { return reinterpret_cast<std::uintptr_t>(ctx) & ~kTagBits; }

// A deleter runs inside torch's noexcept destructors: what goes wrong there is reported, not thrown.
void warn_from_deleter(const char* what) noexcept {
  quietly([&] { TORCH_WARN("gpumem: freeing a CUDA tensor failed: ", what); });
}

}  // namespace

TorchAllocator::TorchAllocator(Backend& backend, std::unique_ptr<CudaContext> context, AllocatorConfig defaults)
    : context_(std::move(context)),
      history_(kMaxDevices),
      traced_(backend, history_),
      core_(traced_, defaults),
      pool_blocks_(kMaxDevices),
      ipc_opened_(make_ipc_opened(traced_)) {
  for (std::atomic<double>& fraction : fractions_) fraction.store(1.0);
  std::lock_guard<std::mutex> lock(adapters_mutex());
  adapters().push_back(this);
}

TorchAllocator::~TorchAllocator() {
  history_.stop();  // the core's teardown releases segments; trackers must not hear of it
  std::lock_guard<std::mutex> lock(adapters_mutex());
  auto& list = adapters();
  list.erase(std::remove(list.begin(), list.end(), this), list.end());
}

void* TorchAllocator::context_of(const Block* block) {
  return in_private_pool(block) ? address_context(block) : const_cast<Block*>(block);
}

Block* TorchAllocator::take_pool_block(std::uintptr_t addr, TorchAllocator** owner) {
  std::lock_guard<std::mutex> lock(adapters_mutex());
  for (TorchAllocator* adapter : adapters()) {
    if (Block* block = adapter->pool_blocks_.take_any(addr)) {
      *owner = adapter;
      return block;
    }
  }
  return nullptr;
}

TorchAllocator& TorchAllocator::owner_of(const Block* block) {
  const gpumem::DeviceAllocator* owner = CachingAllocator::allocator_of(block);
  const int device = owner->device();
  std::lock_guard<std::mutex> lock(adapters_mutex());
  for (TorchAllocator* adapter : adapters()) {
    if (device < adapter->core_.device_count() && adapter->core_.existing(device) == owner) return *adapter;
  }
  TORCH_CHECK(false, "gpumem: a block was freed after the allocator that made it was destroyed");
}

gpumem::DeviceAllocator& TorchAllocator::device(DeviceIndex device) {
  return with_c10_errors([&]() -> gpumem::DeviceAllocator& { return core_.device(device); });
}

void TorchAllocator::record(History::Action action, int device, const void* ptr, size_t size, StreamId stream,
                            PoolId pool, History::Context context) {
  history_.record(action, device, reinterpret_cast<std::uintptr_t>(ptr), size, stream, pool, std::move(context));
}

// ---- allocate and free ----

// Inline in allocate(), its one caller: every tensor's allocation comes through here.
[[gnu::always_inline]] inline Block* TorchAllocator::malloc_block(int device, size_t size, StreamId stream) {
  if (C10_UNLIKELY(history_.active())) return malloc_recorded(device, size, stream, false);
  const std::size_t rounded = torch_compat::power2_division_size(size);
  Block* block = call_core(stream, nullptr, [&] { return core_.malloc(device, size, stream, rounded); });
  if (C10_UNLIKELY(in_private_pool(block))) pool_blocks_.add(device, block);
  return block;
}

c10::DataPtr TorchAllocator::allocate(size_t size) {
  const int device = context_->current_device();
  const c10::Device where(c10::DeviceType::CUDA, static_cast<DeviceIndex>(device));
  // An empty DataPtr still carries gpumem's deleter (never called on null), as native does.
  if (size == 0) return {nullptr, nullptr, &delete_block, where};
  if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) {
    void* ptr = malloc_uncached(device, size);
    return {ptr, reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(ptr) | kUncachedTag), &delete_block, where};
  }
  Block* block = malloc_block(device, size, context_->current_stream(device));
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(device, block->ptr(), block->size);
  return {block->ptr(), C10_UNLIKELY(in_private_pool(block)) ? address_context(block) : block, &delete_block, where};
}

// torch.profiler(profile_memory=True) hears of each block handed out and freed, with the device's
// allocated and reserved totals after it, as native tells it.
void TorchAllocator::report_to_profiler(int device, void* ptr, std::int64_t delta) {
  const DeviceStats stats = core_.device(device).stats();
  c10::reportMemoryUsageToProfiler(ptr, delta, static_cast<size_t>(stats.allocated_bytes[kAll].current),
                                   static_cast<size_t>(stats.reserved_bytes[kAll].current),
                                   c10::Device(c10::DeviceType::CUDA, static_cast<DeviceIndex>(device)));
}

// As native: the stack is taken before the allocator's lock (the recorder takes the GIL), kept
// for the block and the segments the request makes, and put on the trace entries.
Block* TorchAllocator::malloc_recorded(int device, size_t size, StreamId stream, bool raw) {
  History::Context context = history_.gather(History::RecordContext::STATE);
  Block* block = nullptr;
  {
    TracingBackend::Request request(stream, context);
    const std::size_t rounded = torch_compat::power2_division_size(size);
    block = call_core(stream, &context, [&] {
      return raw ? core_.find_raw(core_.raw_alloc(device, size, stream, rounded))
                 : core_.malloc(device, size, stream, rounded);
    });
  }
  const PoolId pool = CachingAllocator::pool_of(block);
  if (!raw && !pool.is_default()) pool_blocks_.add(device, block);
  // As native, where a segment's stack rides on the block heading it and a block split off the
  // front starts without one: once its head is split for a request, a segment shows no stack.
  if (CachingAllocator::heads_a_split(block)) history_.forget(History::kSegments, device, block->addr);
  history_.drop_frees(device, block->addr, block->size);
  history_.remember(History::kBlocks, device, block->addr, context);
  record(History::Action::ALLOC, device, block->ptr(), size, block->stream, pool, std::move(context));
  return block;
}

std::optional<TracingBackend::Request> TorchAllocator::request_scope(StreamId stream, History::RecordContext level) {
  if (!history_.active()) return std::nullopt;
  return std::optional<TracingBackend::Request>(std::in_place, stream, history_.gather(level));
}

void TorchAllocator::delete_block(void* ctx) {
  try {
    if (C10_UNLIKELY(tag_of(ctx) != 0)) {
      if (tag_of(ctx) == kPoolTag) {
        free_pool_address(address_in(ctx));
      } else {
        free_uncached_address(reinterpret_cast<void*>(address_in(ctx)));
      }
      return;
    }
    auto* block = static_cast<Block*>(ctx);
    if (C10_UNLIKELY(History::any_active() || c10::memoryProfilingEnabled())) {
      owner_of(block).free_recorded(block);
      return;
    }
    CachingAllocator::free(block);
  } catch (const std::exception& e) {
    warn_from_deleter(e.what());
  } catch (...) {
    warn_from_deleter("unknown error");
  }
}

void TorchAllocator::free_pool_address(std::uintptr_t addr) {
  TorchAllocator* owner = nullptr;
  Block* block = take_pool_block(addr, &owner);
  // Native would throw here, inside a destructor, and end the process. The address was freed
  // already: a tensor torch should have named as stale to a checkpoint restore, or a double free.
  TORCH_CHECK(block, "no block of a CUDA graph's private pool starts at ", reinterpret_cast<void*>(addr),
              " (freed twice, or freed by a checkpoint restore that was not told of this tensor)");
  owner->free_recorded(block);
}

void* TorchAllocator::malloc_uncached(int device, size_t size) {
  return call_core(context_->current_stream(device), nullptr, [&] { return core_.device(device).malloc_uncached(size); });
}

bool TorchAllocator::free_uncached(void* ptr) {
  for (int d = 0; d < core_.device_count(); ++d) {
    gpumem::DeviceAllocator* device = core_.existing(d);
    if (device && device->free_uncached(ptr)) return true;
  }
  return false;
}

void TorchAllocator::free_uncached_address(void* ptr) {
  std::lock_guard<std::mutex> lock(adapters_mutex());
  for (TorchAllocator* adapter : adapters()) {
    if (adapter->free_uncached(ptr)) return;
  }
  TORCH_CHECK(false, "no memory handed out with caching off starts at ", ptr, " (freed twice?)");
}

void TorchAllocator::free_told(Block* block) {
  const int device = CachingAllocator::device_of(block);
  void* const ptr = block->ptr();
  const auto size = static_cast<std::int64_t>(block->size);
  std::optional<TracingBackend::Request> request;
  if (history_.active()) request.emplace(block->stream, record_free(device, block));
  CachingAllocator::free(block);
  request.reset();
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(device, ptr, -size);
}

// The free entries of `block`, with the freeing stack where recording keeps it (ALL), else the
// allocating one, as native; returns the freeing stack for the segment entries the free causes.
History::Context TorchAllocator::record_free(int device, const Block* block) {
  const PoolId pool = CachingAllocator::pool_of(block);
  History::Context freeing = history_.gather(History::RecordContext::ALL);
  History::Context allocating = history_.forget(History::kBlocks, device, block->addr);
  history_.note_free(device, block->addr, block->requested);
  const History::Context& context = freeing ? freeing : allocating;
  record(History::Action::FREE_REQUESTED, device, block->ptr(), block->requested, block->stream, pool, context);
  // A block still used by other streams completes later, inside the core, unseen by the history.
  if (block->stream_uses.empty()) {
    record(History::Action::FREE_COMPLETED, device, block->ptr(), block->requested, block->stream, pool, context);
  }
  return freeing;
}

void TorchAllocator::report_oom(const OutOfMemoryError& error, StreamId stream, const History::Context& context) {
  const OomInfo& info = error.info();
  c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(info.requested), info.allocated, info.reserved,
                                   c10::Device(c10::DeviceType::CUDA, static_cast<DeviceIndex>(info.device)));
  if (history_.active()) {
    record(History::Action::OOM, info.device, reinterpret_cast<void*>(info.device_free), info.requested, stream, {},
           context);
  }
  std::vector<OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    observers = oom_observers_;
  }
  for (const auto& observer : observers) observer(info.device, info.requested, info.device_total, info.device_free);
  TORCH_CHECK_WITH(OutOfMemoryError, false, error.what());
}

c10::DeleterFnPtr TorchAllocator::raw_deleter() const { return &delete_block; }

#if GPUMEM_TORCH_HAS_IS_SIMPLE_DATA_PTR
bool TorchAllocator::is_simple_data_ptr(const DataPtr& ptr) const {
  return owns(ptr) || ptr.get() == ptr.get_context();
}
#endif

bool TorchAllocator::owns(const DataPtr& ptr) { return ptr.get_deleter() == &delete_block; }

// ---- raw pointers ----

// Inline in its two callers: part 1's pairs, and every raw allocation, come through here.
[[gnu::always_inline]] inline void* TorchAllocator::raw_alloc_on(int device, size_t nbytes, StreamId stream) {
  if (nbytes == 0) return nullptr;
  if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) return malloc_uncached(device, nbytes);
  if (C10_UNLIKELY(history_.active())) {
    const Block* block = malloc_recorded(device, nbytes, stream, true);
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(device, block->ptr(), block->size);
    return block->ptr();
  }
  const std::size_t rounded = torch_compat::power2_division_size(nbytes);
  void* ptr = call_core(stream, nullptr, [&] { return core_.raw_alloc(device, nbytes, stream, rounded); });
  // As for a tensor: the profiler hears of the block (raw_delete tells it of the free).
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(device, ptr, core_.find_raw(ptr)->size);
  return ptr;
}

void* TorchAllocator::raw_alloc(size_t nbytes) {
  const int device = context_->current_device();
  return raw_alloc_on(device, nbytes, context_->current_stream(device));
}

void* TorchAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  return raw_alloc_on(context_->current_device(), nbytes, reinterpret_cast<StreamId>(stream));
}

void TorchAllocator::raw_delete(void* ptr) {
  if (!ptr) return;
  Block* block = core_.take_raw(ptr);
  // A private-pool block whose DataPtr torch let go of: cudagraph trees free those by address.
  if (!block) block = pool_blocks_.take_any(reinterpret_cast<std::uintptr_t>(ptr));
  if (!block && with_c10_errors([&] { return free_uncached(ptr); })) return;
  TORCH_CHECK(block, "gpumem: raw_delete of ", ptr,
              ", which gpumem did not hand out through raw_alloc or to a CUDA graph's private pool");
  with_c10_errors([&] { free_recorded(block); });
}

// ---- streams ----

void TorchAllocator::recordStream(const DataPtr& ptr, c10::cuda::CUDAStream stream) {
  record_stream(ptr, reinterpret_cast<StreamId>(stream.stream()));
}

void TorchAllocator::record_stream(const DataPtr& ptr, StreamId stream) {
  // Empty tensors have no block; DataPtrs of other allocators are not gpumem's to track.
  if (!ptr.get_context() || !owns(ptr)) return;
  Block* block = static_cast<Block*>(ptr.get_context());
  if (tag_of(block) == kUncachedTag) return;  // given back to the device when freed: nothing reuses it early
  if (tag_of(block) == kPoolTag) {
    block = pool_blocks_.find_any(address_in(block));
    TORCH_CHECK(block, "gpumem: record_stream on a tensor whose memory at ", ptr.get(), " was already freed");
  }
  with_c10_errors([&] { CachingAllocator::record_stream(block, stream); });
}

// ---- lifecycle and observers ----

void TorchAllocator::init(int /*device_count*/) {
  // torch's lazy CUDA init calls this once it has counted the devices; gpumem's come from its
  // backend, and each device's allocator is made on first use. What the settings read at install
  // need of the devices (a percentage, a device number) is checked now, so that a bad one is an
  // error at torch's init; it throws again at each later init until fixed.
  with_c10_errors([&] { core_.run_setup(); });
  initialized_.store(true);
}

bool TorchAllocator::initialized() { return initialized_.load(); }

void TorchAllocator::enable(bool value) { enabled_.store(value); }

bool TorchAllocator::isEnabled() const { return enabled_.load(); }

std::string TorchAllocator::name() { return "native"; }

void TorchAllocator::attachOutOfMemoryObserver(OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lock(observers_mutex_);
  oom_observers_.push_back(std::move(observer));
}

#if GPUMEM_TORCH_HAS_OOM_REJECTION_OBSERVER
void TorchAllocator::attachOomRejectionObserver(c10::cuda::CUDACachingAllocator::OomRejectionObserver /*observer*/) {
  // gpumem has no path that rejects a request before trying it, so the observer would never be
  // called; accepting it keeps torch's setup code working.
}
#endif

void TorchAllocator::attachAllocatorTraceTracker(AllocatorTraceTracker tracker) {
  history_.attach_tracker(std::move(tracker));
}

}  // namespace gpumem
