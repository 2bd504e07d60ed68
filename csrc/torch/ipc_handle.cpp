#include "torch/ipc_handle.h"

#include <cstring>
#include <stdexcept>

#ifndef GPUMEM_TORCH_VERSION_MINOR
#define GPUMEM_TORCH_VERSION_MINOR 0
#endif

namespace gpumem::ipc {

namespace {

constexpr char kPlainKind = 'c';
constexpr char kChunksKind = 'e';
constexpr char kMixedKind = 'g';
constexpr std::int32_t kFdHandles = 1;
constexpr std::int32_t kFabricHandles = 2;

constexpr const char* kForms =
    "a CUDA IPC handle of torch's layout: 64 bytes (a bare cudaIpcMemHandle_t), or a version byte (1 to 3) "
    "and a kind ('c' a plain segment, 'e' growable memory, 'g' gpumem's growable memory in chunks of several sizes)";

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Reads the handle front to back; every read checks the length, so a short handle is an error.
class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, s_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }
  std::size_t left() const { return s_.size() - at_; }
  std::string take(std::size_t n, const char* what) {
    need(n, what);
    std::string out = s_.substr(at_, n);
    at_ += n;
    return out;
  }

 private:
  void need(std::size_t n, const char* what) const {
    if (left() < n) {
      throw std::invalid_argument("gpumem: a CUDA IPC handle of " + std::to_string(s_.size()) + " bytes ends inside its " +
                                  what + "; expected " + kForms);
    }
  }
  const std::string& s_;
  std::size_t at_ = 0;
};

[[noreturn]] void bad(const std::string& handle, const std::string& why) {
  throw std::invalid_argument("gpumem: a CUDA IPC handle of " + std::to_string(handle.size()) + " bytes " + why +
                              "; expected " + kForms);
}

}  // namespace

int share_version() {
  if (GPUMEM_TORCH_VERSION_MINOR >= 13) return 3;
  if (GPUMEM_TORCH_VERSION_MINOR >= 8) return 2;
  return 1;
}

std::string encode_plain(int version, const std::string& cuda_handle) {
  if (cuda_handle.size() != kCudaHandleBytes) {
    throw std::invalid_argument("gpumem: a CUDA handle of " + std::to_string(cuda_handle.size()) + " bytes; expected 64");
  }
  std::string out;
  out.push_back(static_cast<char>(version));
  out.push_back(kPlainKind);
  out += cuda_handle;
  return out;
}

std::string encode_chunks(int version, int pid, const std::vector<int>& fds, const std::vector<std::size_t>& bytes) {
  if (fds.empty() || fds.size() != bytes.size()) {
    throw std::invalid_argument("gpumem: a growable handle needs one size per descriptor and at least one; got " +
                                std::to_string(fds.size()) + " descriptors and " + std::to_string(bytes.size()) + " sizes");
  }
  bool one_size = true;
  for (const std::size_t b : bytes) one_size = one_size && b == bytes.front();
  std::string out;
  out.push_back(static_cast<char>(version));
  out.push_back(one_size ? kChunksKind : kMixedKind);
  put<std::int32_t>(out, pid);
  put<std::uint32_t>(out, 0);
  if (one_size) {
    put<std::uint64_t>(out, bytes.front());
    put<std::uint64_t>(out, fds.size());
    if (version >= 3) {
      put<std::int32_t>(out, kFdHandles);
      put<std::uint32_t>(out, 0);
    }
    for (const int fd : fds) put<std::int32_t>(out, fd);
  } else {
    put<std::uint64_t>(out, fds.size());
    for (std::size_t i = 0; i < fds.size(); ++i) {
      put<std::int32_t>(out, fds[i]);
      put<std::uint32_t>(out, 0);
      put<std::uint64_t>(out, bytes[i]);
    }
  }
  return out;
}

Handle decode(const std::string& handle) {
  Handle h;
  if (handle.size() == kCudaHandleBytes) {  // before the version byte: a bare plain handle
    h.cuda_handle = handle;
    return h;
  }
  Reader in(handle);
  h.version = static_cast<unsigned char>(in.get<char>("version"));
  if (h.version < 1 || h.version > kNewestVersion) {
    bad(handle, "has version " + std::to_string(h.version) + ", which gpumem does not know" +
                    (h.version > kNewestVersion ? " (from a newer torch than gpumem knows)" : ""));
  }
  const char kind = in.get<char>("kind");
  if (kind == kPlainKind) {
    h.cuda_handle = in.take(kCudaHandleBytes, "CUDA handle");
    if (in.left() != 0) bad(handle, "has " + std::to_string(in.left()) + " bytes after its plain segment's CUDA handle");
    return h;
  }
  if (kind != kChunksKind && kind != kMixedKind) {
    bad(handle, std::string("has kind byte ") + std::to_string(static_cast<unsigned char>(kind)));
  }
  h.kind = Handle::Kind::kChunks;
  h.pid = in.get<std::int32_t>("pid");
  in.get<std::uint32_t>("padding");
  if (kind == kMixedKind) {
    const auto n = in.get<std::uint64_t>("chunk count");
    if (n == 0 || n > in.left() / 16 || in.left() != n * 16) bad(handle, "does not hold the " + std::to_string(n) + " chunks it counts");
    for (std::uint64_t i = 0; i < n; ++i) {
      h.fds.push_back(in.get<std::int32_t>("descriptor"));
      in.get<std::uint32_t>("padding");
      h.bytes.push_back(in.get<std::uint64_t>("chunk size"));
    }
    return h;
  }
  const auto chunk = in.get<std::uint64_t>("chunk size");
  const auto n = in.get<std::uint64_t>("chunk count");
  std::int32_t handle_kind = kFdHandles;
  if (h.version >= 3) {
    handle_kind = in.get<std::int32_t>("handle kind");
    in.get<std::uint32_t>("padding");
  } else if (n > 0 && in.left() == n * kCudaHandleBytes) {
    handle_kind = kFabricHandles;  // torch 2.11 writes fabric handles with no field saying so
  }
  if (n == 0 || chunk == 0) bad(handle, "shares no memory (" + std::to_string(n) + " chunks of " + std::to_string(chunk) + " bytes)");
  if (handle_kind != kFdHandles && handle_kind != kFabricHandles && handle_kind != 0) {
    bad(handle, "has handle kind " + std::to_string(handle_kind));
  }
  h.fabric = handle_kind == kFabricHandles;
  const std::size_t entry = h.fabric ? kCudaHandleBytes : sizeof(std::int32_t);
  if (n > in.left() / entry || in.left() != n * entry) bad(handle, "does not hold the " + std::to_string(n) + " chunks it counts");
  for (std::uint64_t i = 0; i < n; ++i) {
    if (h.fabric) {
      in.take(kCudaHandleBytes, "fabric handle");
      h.fds.push_back(-1);
    } else {
      h.fds.push_back(in.get<std::int32_t>("descriptor"));
    }
    h.bytes.push_back(chunk);
  }
  return h;
}

}  // namespace gpumem::ipc
