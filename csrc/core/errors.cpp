#include "core/errors.h"

#include <algorithm>
#include <cstdio>
#include <utility>

namespace gpumem {

const char* oom_kind_name(OomKind kind) {
  switch (kind) {
    case OomKind::kOverLimit: return "over the limit";
    case OomKind::kDeviceFull: return "device full";
    case OomKind::kFragmentation: return "fragmentation";
  }
  return "unknown";
}

std::string format_bytes(std::size_t bytes) {
  static const char* const units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return std::to_string(bytes) + (bytes == 1 ? " byte" : " bytes");
  double value = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  while (value >= 1024.0 && unit < 3) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
  return text;
}

namespace {

const char* advice(OomKind kind) {
  switch (kind) {
    case OomKind::kOverLimit:
      return "The live tensors and this request do not fit under the limit: raise it with gpumem.set_limit() or "
             "GPUMEM_LIMIT, or use less memory (a smaller batch).";
    case OomKind::kDeviceFull:
      return "The device itself has no free memory left (other processes or libraries hold it); the gpumem "
             "limit was not reached.";
    case OomKind::kFragmentation:
      return "Enough memory is free under the limit, but no cached block is large enough and no new segment "
             "fits; gpumem.empty_cache() or a slightly higher limit may help.";
  }
  return "";
}

// Sizes as PyTorch's out-of-memory message writes them: bytes up to 1 KiB, then KiB, MiB and GiB
// with two decimals, each bound inclusive (1 MiB is "1024.00 KiB"), never TiB.
std::string native_size(std::size_t bytes) {
  constexpr std::size_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;
  if (bytes <= KiB) return std::to_string(bytes) + " bytes";
  const auto [scale, unit] = bytes <= MiB ? std::pair{KiB, "KiB"} : bytes <= GiB ? std::pair{MiB, "MiB"} : std::pair{GiB, "GiB"};
  char text[48];
  std::snprintf(text, sizeof text, "%.2f %s", static_cast<double>(bytes) / static_cast<double>(scale), unit);
  return text;
}

// Begins word for word as PyTorch's own message, which tools match ("CUDA out of memory. Tried to
// allocate"; HF accelerate's batch-size finder), then says which of gpumem's cases it is.
std::string oom_message(const OomInfo& i) {
  constexpr std::size_t kOneExbibyte = std::size_t{1} << 60;
  const std::string tried = i.requested >= kOneExbibyte ? "more than 1EB memory" : native_size(i.requested);
  const std::string allowed = i.limit < i.device_total ? native_size(i.limit) + " allowed; " : "";
  return "CUDA out of memory. Tried to allocate " + tried + ". GPU " + std::to_string(i.device) +
         " has a total capacity of " + native_size(i.device_total) + " of which " + native_size(i.device_free) +
         " is free. " + allowed + "Of the allocated memory " + native_size(i.allocated) +
         " is allocated by PyTorch, and " + native_size(i.reserved - std::min(i.reserved, i.allocated)) +
         " is reserved by PyTorch but unallocated. gpumem: " + oom_kind_name(i.kind) + ", under a limit of " +
         native_size(i.limit) + "; the largest free cached block is " + native_size(i.largest_free_block) + ". " +
         advice(i.kind);
}

}  // namespace

OutOfMemoryError::OutOfMemoryError(const OomInfo& info) : info_(info), message_(oom_message(info)) {}

}  // namespace gpumem
