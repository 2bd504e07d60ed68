// A paused region's backup in host memory (Backend::back_up, allocate_backup, restore and
// drop_backup of the CUDA backend; core/pause.cpp says when each is called).
//
// A backup's host memory is ordinary memory (mmap) that CUDA pins (cudaHostRegister) in pieces of
// kPinPiece: pinning new memory runs far below the copies (the kernel faults, zeroes and locks each
// page), so several threads pin pieces while the copies of the pieces pinned already run. Copies go
// in pieces of kCopyPiece, alternating between two streams of their own; each lies inside one
// pinned piece, also where a range is copied at an offset inside a larger backup. allocate_backup
// pins without copying; drop_backup unpins the pieces and unmaps the memory.
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <array>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda_backend.h"
#include "backends/cuda_calls.h"
#include "backends/piece_pinning.h"

namespace gpumem {

using cuda_calls::check;
using cuda_calls::DeviceScope;

namespace {

constexpr std::size_t kCopyPiece = std::size_t{64} << 20;
constexpr std::size_t kPinPiece = std::size_t{256} << 20;
static_assert(kPinPiece % kCopyPiece == 0, "a copy lies inside one pinned piece");

unsigned pin_threads() {
  const unsigned cores = std::thread::hardware_concurrency();
  return std::clamp(cores / 2, 1u, 8u);
}

std::size_t pieces_of(std::size_t bytes) { return (bytes + kPinPiece - 1) / kPinPiece; }

// Unpins the pieces k of a backup's `host` (of `bytes`) where pinned(k), and unmaps it.
template <typename Pinned>
void free_host(void* host, std::size_t bytes, Pinned pinned) noexcept {
  for (std::size_t k = 0; k < pieces_of(bytes); ++k) {
    if (pinned(k)) cudaHostUnregister(static_cast<char*>(host) + k * kPinPiece);
  }
  cudaGetLastError();
  munmap(host, bytes);
}

// Faults in every page of new memory, on the calling thread: cudaHostRegister of memory whose pages
// are there already runs several times faster than one that faults them itself (on the H100
// measured, benchmarks/bench_pinning.py: 23 GiB/s to touch and 41 GiB/s to register, in threads).
void touch(char* at, std::size_t bytes) noexcept {
  for (std::size_t page = 0; page < bytes; page += 4096) static_cast<volatile char*>(at)[page] = 0;
}

// New host memory for the ranges that have none, mapped at once and pinned in pieces by a
// PiecePinning's threads. free() gives back what it mapped and stops the pinning; a throw from
// the constructor has done so. `what`: the work it is for, for the error.
class FreshHost {
 public:
  FreshHost(int device, std::vector<HostCopy>& copies, const char* what) : copies_(copies) {
    try {
      for (std::size_t i = 0; i < copies.size(); ++i) {
        if (!copies[i].host) map(i, what);  // else held already
      }
      pinning_.emplace(pieces_.size(), pin_threads(), [this, device](std::size_t k) {
        touch(pieces_[k].at, pieces_[k].bytes);
        cudaError_t status = cudaSetDevice(device);  // a thread of the pinning's own, or this one
        if (status == cudaSuccess) status = cudaHostRegister(pieces_[k].at, pieces_[k].bytes, cudaHostRegisterPortable);
        if (status != cudaSuccess) cudaGetLastError();
        return static_cast<int>(status);
      });
    } catch (...) {
      free();
      throw;
    }
  }
  FreshHost(const FreshHost&) = delete;
  FreshHost& operator=(const FreshHost&) = delete;

  PiecePinning& pinning() { return *pinning_; }
  const std::map<std::size_t, std::size_t>& first_piece() const { return first_piece_; }
  std::size_t pieces() const { return pieces_.size(); }

  // Stops the pinning, unpins what it pinned and unmaps what was mapped here (those `host` null again).
  void free() noexcept {
    if (pinning_) pinning_->stop();
    for (const auto& [i, first] : first_piece_) {
      const std::size_t at = first;  // its first piece, as the pinning counts them
      free_host(copies_[i].host, copies_[i].bytes, [&](std::size_t k) { return pinning_ && pinning_->pinned(at + k); });
      copies_[i].host = nullptr;
    }
    first_piece_.clear();
  }

 private:
  struct Piece {
    char* at;
    std::size_t bytes;
  };

  void map(std::size_t i, const char* what) {
    HostCopy& c = copies_[i];
    void* host = mmap(nullptr, c.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (host == MAP_FAILED) {
      const int error = errno;
      throw std::runtime_error(std::string("gpumem: cannot ") + what + ": host memory for " + std::to_string(c.bytes) +
                               " bytes could not be mapped (" + std::strerror(error) + ")");
    }
    try {
      first_piece_.emplace(i, pieces_.size());  // owned from here: free() unmaps it
    } catch (...) {
      munmap(host, c.bytes);
      throw;
    }
    c.host = host;
    c.offset = 0;
    madvise(host, c.bytes, MADV_HUGEPAGE);  // fewer pages to fault and pin where the kernel has huge pages
    for (std::size_t at = 0; at < c.bytes; at += kPinPiece) {
      pieces_.push_back({static_cast<char*>(host) + at, std::min(kPinPiece, c.bytes - at)});
    }
  }

  std::vector<HostCopy>& copies_;
  std::map<std::size_t, std::size_t> first_piece_;  // copy index -> its first piece in pieces_
  std::vector<Piece> pieces_;
  std::optional<PiecePinning> pinning_;  // last: its threads stop before pieces_ goes
};

constexpr const char* kPinFailed = "pinning host memory for a paused region's backup (cudaHostRegister)";

cudaError_t pin_error(int pinned) {
  return pinned == PiecePinning::kGivenUp ? cudaErrorUnknown : static_cast<cudaError_t>(pinned);
}

// Copies every range between the device and its host copy, in pieces alternating between two
// streams of their own, and waits for them all; a piece of a range `fresh` mapped is queued once
// its pinned piece is pinned. The streams go whatever happens.
void copy_all(const std::vector<HostCopy>& copies, bool to_host, FreshHost* fresh = nullptr) {
  std::array<cudaStream_t, 2> streams{};
  for (cudaStream_t& stream : streams) check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaError_t status = cudaSuccess;
  const char* failed = to_host ? "copying a paused region to the host" : "copying a paused region back to the device";
  std::size_t piece = 0;
  for (std::size_t i = 0; i < copies.size() && status == cudaSuccess; ++i) {
    const HostCopy& c = copies[i];
    const auto first = fresh ? fresh->first_piece().find(i) : std::map<std::size_t, std::size_t>::const_iterator{};
    const bool pinning = fresh && first != fresh->first_piece().end();
    for (std::size_t at = 0; at < c.bytes && status == cudaSuccess; ++piece) {
      const std::size_t in_host = c.offset + at;
      if (pinning && in_host % kPinPiece == 0) {
        const int pinned = fresh->pinning().wait_for(first->second + in_host / kPinPiece);
        if (pinned != 0) {
          status = pin_error(pinned);
          failed = kPinFailed;
          break;
        }
      }
      const std::size_t n = std::min(kCopyPiece - in_host % kCopyPiece, c.bytes - at);
      void* device_ptr = reinterpret_cast<void*>(c.device_addr + at);
      void* host_ptr = static_cast<char*>(c.host) + in_host;
      status = to_host ? cudaMemcpyAsync(host_ptr, device_ptr, n, cudaMemcpyDeviceToHost, streams[piece % 2])
                       : cudaMemcpyAsync(device_ptr, host_ptr, n, cudaMemcpyHostToDevice, streams[piece % 2]);
      at += n;
    }
  }
  for (cudaStream_t stream : streams) {
    const cudaError_t synced = cudaStreamSynchronize(stream);
    if (status == cudaSuccess) status = synced;
    cudaStreamDestroy(stream);
  }
  check(status, failed);
}

}  // namespace

void CudaBackend::back_up(int device, std::vector<HostCopy>& copies) {
  DeviceScope scope(device);
  FreshHost fresh(device, copies, "back up a paused region");
  try {
    copy_all(copies, true, &fresh);
  } catch (...) {
    fresh.free();
    throw;
  }
}

void CudaBackend::allocate_backup(int device, std::vector<HostCopy>& copies) {
  DeviceScope scope(device);
  FreshHost fresh(device, copies, "prepare a region's backup");
  for (std::size_t k = 0; k < fresh.pieces(); ++k) {
    const int pinned = fresh.pinning().wait_for(k);
    if (pinned != 0) {
      fresh.free();
      check(pin_error(pinned), kPinFailed);
    }
  }
}

void CudaBackend::restore(int device, const std::vector<HostCopy>& copies) {
  DeviceScope scope(device);
  copy_all(copies, false);
}

void CudaBackend::drop_backup(int /*device*/, std::vector<HostCopy>& copies) noexcept {
  for (HostCopy& c : copies) {
    if (c.host) free_host(c.host, c.bytes, [](std::size_t) { return true; });
    c.host = nullptr;
  }
}

}  // namespace gpumem
