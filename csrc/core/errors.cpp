#include "core/errors.h"

#include <algorithm>
#include <cstdio>

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

std::string oom_message(const OomInfo& i) {
  return "CUDA out of memory (gpumem: " + std::string(oom_kind_name(i.kind)) + "). Tried to allocate " +
         format_bytes(i.requested) + ". GPU " + std::to_string(i.device) + " has a total capacity of " +
         format_bytes(i.device_total) + " of which " + format_bytes(i.device_free) + " is free. The gpumem limit is " +
         format_bytes(i.limit) + ". Of the allocated memory " + format_bytes(i.allocated) +
         " is allocated by PyTorch, and " + format_bytes(i.reserved - std::min(i.reserved, i.allocated)) +
         " is reserved by PyTorch but unallocated; the largest free cached block is " +
         format_bytes(i.largest_free_block) + ". " + advice(i.kind);
}

}  // namespace

OutOfMemoryError::OutOfMemoryError(const OomInfo& info) : info_(info), message_(oom_message(info)) {}

}  // namespace gpumem
