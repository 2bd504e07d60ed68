// CUDA tensors sent to and received from other processes (torch.multiprocessing, reduce_tensor).
//
// Sending: torch asks shareIpcHandle for the storage's pointer; gpumem finds the allocated block
// and the memory behind it (DeviceAllocator::share_range) and writes a handle in torch's layout
// (torch/ipc_handle.h): a plain segment's cudaIpcMemHandle, or the file descriptors of the growable
// chunks the block lies on. torch then keeps the storage's DataPtr alive until every receiver let
// go (its cross-process reference counts; torch.cuda.ipc_collect frees what they released), so the
// block stays allocated meanwhile: it counts under this process's cap, is never reused, and its
// memory is never unmapped or given to a neighbour, since only free memory ever is.
//
// Receiving: getIpcDevPtr opens the handle on the current device and returns its memory's start;
// torch adds the offset. That memory is the sender's: it is mapped here but counts under no cap of
// this process (gpumem's statistics never see it). One process can open a plain handle only once,
// so what is open is kept by handle, as native does, and shared by every storage on it; the last
// one to go closes it.
#include <unistd.h>

#include <mutex>
#include <sstream>
#include <unordered_map>

#include <c10/util/Exception.h>

#include "torch/allocator.h"
#include "torch/error_bridge.h"
#include "torch/ipc_handle.h"

namespace gpumem {

// What a receiver that cannot take growable memory is told to do.
constexpr const char* kSendPlain =
    "send from a process with plain segments (GPUMEM_SEGMENTS=plain under gpumem, or expandable_segments:False natively)";

class IpcOpened {
 public:
  explicit IpcOpened(Backend& backend) : backend_(backend) {}

  // The memory `handle` names, mapped on `device`: opened now, or shared with an earlier open of
  // the same handle still in use.
  static std::shared_ptr<void> open(const std::shared_ptr<IpcOpened>& self, int device, const std::string& handle) {
    std::lock_guard<std::mutex> lock(self->mutex_);
    const auto found = self->opened_.find(handle);
    if (found != self->opened_.end()) {
      if (std::shared_ptr<void> alive = found->second.lock()) return alive;
    }
    const ipc::Handle h = ipc::decode(handle);
    void* ptr = nullptr;
    if (h.kind == ipc::Handle::Kind::kPlain) {
      ptr = self->backend_.open_segment(device, h.cuda_handle);
    } else {
      if (h.fabric) {
        throw std::runtime_error(std::string("gpumem: the sender shared growable memory as fabric handles, which gpumem "
                                             "cannot open; ") + kSendPlain);
      }
      try {
        ptr = self->backend_.open_chunks(device, h.pid, h.fds, h.bytes);
      } catch (const std::runtime_error& error) {
        throw std::runtime_error(std::string(error.what()) +
                                 ". Growable memory passes between processes of one user where the kernel lets one take "
                                 "another's file descriptors (pidfd_getfd); elsewhere, " + kSendPlain);
      }
    }
    // The deleter reaches the table through a weak pointer: once the adapter is gone (the
    // process's end) it leaves the memory mapped.
    std::weak_ptr<IpcOpened> table = self;
    std::shared_ptr<void> opened(ptr, [table, device, h, handle](void* p) {
      const std::shared_ptr<IpcOpened> owner = table.lock();
      if (!owner) return;
      owner->close(device, h, handle, p);
    });
    self->opened_[handle] = opened;
    return opened;
  }

  std::size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t n = 0;
    for (const auto& entry : opened_) n += entry.second.expired() ? 0 : 1;
    return n;
  }

 private:
  // Runs in torch's storage destructors: it never throws, a failure is a warning.
  void close(int device, const ipc::Handle& h, const std::string& handle, void* ptr) noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto found = opened_.find(handle);
      if (found != opened_.end() && found->second.expired()) opened_.erase(found);
    }
    try {
      if (h.kind == ipc::Handle::Kind::kPlain) {
        backend_.close_segment(device, ptr);
      } else {
        backend_.close_chunks(device, ptr, h.bytes);
      }
    } catch (const std::exception& error) {
      TORCH_WARN("gpumem: closing memory received from another process failed: ", error.what());
    }
  }

  Backend& backend_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> opened_;
};

std::shared_ptr<IpcOpened> make_ipc_opened(Backend& backend) { return std::make_shared<IpcOpened>(backend); }

#if GPUMEM_TORCH_HAS_SHARE_IPC_HANDLE
TorchAllocator::ShareableHandle TorchAllocator::shareIpcHandle(void* ptr) {
  return with_c10_errors([&] {
    for (gpumem::DeviceAllocator* device : core_.existing_devices()) {
      const std::optional<ShareRange> range = device->share_range(ptr);
      if (!range) continue;
      const int d = device->device();
      const std::uintptr_t start = range->memory.front().first;
      const auto offset = static_cast<std::ptrdiff_t>(reinterpret_cast<std::uintptr_t>(ptr) - start);
      if (!range->growable) {
        return ShareableHandle{offset, ipc::encode_plain(ipc::share_version(), traced_.export_segment(d, reinterpret_cast<void*>(start)))};
      }
      std::vector<std::size_t> bytes;
      for (const auto& chunk : range->memory) bytes.push_back(chunk.second);
      const std::vector<int> fds = traced_.export_chunks(d, range->memory);
      return ShareableHandle{offset, ipc::encode_chunks(ipc::share_version(), static_cast<int>(getpid()), fds, bytes)};
    }
    std::ostringstream message;
    message << "gpumem: cannot share " << ptr << " with another process: it lies in no tensor gpumem allocated "
            << "(memory gpumem does not cache, with caching off, cannot be shared)";
    throw std::invalid_argument(message.str());
  });
}
#endif

std::shared_ptr<void> TorchAllocator::getIpcDevPtr(std::string handle) {
  return with_c10_errors([&] { return IpcOpened::open(ipc_opened_, context_->current_device(), handle); });
}

std::size_t TorchAllocator::ipc_opened() const { return ipc_opened_->size(); }

}  // namespace gpumem
