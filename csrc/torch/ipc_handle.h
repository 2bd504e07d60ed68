// The bytes of a CUDA IPC handle, as torch passes them between processes (torch/ipc.cpp makes and
// opens them). gpumem writes the layout torch's native allocator of the same release writes, so a
// native receiver opens what gpumem sends, and reads every layout the supported releases write:
//
//   byte 0      version: 1 (torch 2.6, 2.7), 2 (2.8 to 2.12), 3 (2.13 on); see share_version()
//   byte 1      kind: 'c' a plain segment, 'e' growable memory in chunks of one size,
//               'g' growable memory in chunks of several sizes (gpumem's own; native cannot map it)
//   'c'         the 64-byte cudaIpcMemHandle_t of the segment's start
//   'e'         a header: pid (int32), 4 zero bytes, chunk bytes (uint64), chunks (uint64), and from
//               version 3 the handle kind (int32: 1 file descriptors, 2 fabric) and 4 zero bytes;
//               then one entry per chunk: the sender's file descriptor (int32), or a 64-byte fabric
//               handle (torch 2.8 to 2.12 write those with no field saying so: the length tells)
//   'g'         pid (int32), 4 zero bytes, chunks (uint64), then per chunk its descriptor (int32),
//               4 zero bytes and its bytes (uint64)
// A bare 64-byte cudaIpcMemHandle_t (torch before the version byte) is a plain segment.
// Padding is zero, so one memory's handle is the same string each time (receivers cache by it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace gpumem::ipc {

constexpr std::size_t kCudaHandleBytes = 64;  // cudaIpcMemHandle_t, CUmemFabricHandle
constexpr int kNewestVersion = 3;

// What a handle says: a plain segment's CUDA handle, or the chunks of growable memory.
struct Handle {
  enum class Kind { kPlain, kChunks };
  Kind kind = Kind::kPlain;
  int version = 0;
  std::string cuda_handle;           // kPlain: 64 bytes
  int pid = 0;                       // kChunks: the sender's pid
  bool fabric = false;               // kChunks: fabric handles instead of descriptors (not supported to open)
  std::vector<int> fds;              // kChunks: the sender's descriptor numbers, in address order
  std::vector<std::size_t> bytes;    // kChunks: each chunk's size
};

// The version this build's torch writes (from its release: GPUMEM_TORCH_VERSION_MINOR).
int share_version();

std::string encode_plain(int version, const std::string& cuda_handle);
// Chunks of one size make an 'e' handle, which native receivers open too; chunks of several sizes
// a 'g' handle.
std::string encode_chunks(int version, int pid, const std::vector<int>& fds, const std::vector<std::size_t>& bytes);
// std::invalid_argument naming what is wrong (its length, version, kind, sizes), with the forms
// accepted.
Handle decode(const std::string& handle);

}  // namespace gpumem::ipc
