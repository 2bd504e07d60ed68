// Typed errors and the out-of-memory message made from their fields (core/errors.h).
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

// The length of the UTF-8 sequence at the start of `s`, or 0 if it is not one.
std::size_t utf8_length(std::string_view s) {
  const auto lead = static_cast<unsigned char>(s[0]);
  const std::size_t n = lead >= 0xF0 && lead <= 0xF4 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC2 && lead < 0xE0 ? 2 : 0;
  if (n == 0 || lead >= 0xF5 || s.size() < n) return 0;
  for (std::size_t i = 1; i < n; ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) return 0;
  }
  // Overlong forms, UTF-16 surrogates and code points past U+10FFFF are not UTF-8 either.
  const auto second = static_cast<unsigned char>(s[1]);
  if ((lead == 0xE0 && second < 0xA0) || (lead == 0xED && second >= 0xA0) || (lead == 0xF0 && second < 0x90) ||
      (lead == 0xF4 && second >= 0x90)) {
    return 0;
  }
  return n;
}

void escape(unsigned char c, std::string& out) {
  static const char digits[] = "0123456789abcdef";
  switch (c) {
    case '\n': out += "\\n"; return;
    case '\t': out += "\\t"; return;
    case '\r': out += "\\r"; return;
    case '"': out += "\\\""; return;
    case '\\': out += "\\\\"; return;
    default: out += "\\x"; out += digits[c >> 4]; out += digits[c & 15];
  }
}

}  // namespace

std::string shown(std::string_view text) {
  std::string out = "\"";
  std::size_t i = 0;
  while (i < text.size() && i < kShownBytes) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\') {
      out += static_cast<char>(c);
      ++i;
    } else if (const std::size_t n = c >= 0x80 ? utf8_length(text.substr(i)) : 0) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      escape(c, out);
      ++i;
    }
  }
  out += '"';
  if (i < text.size()) out += "... (" + std::to_string(text.size()) + " bytes in all)";
  return out;
}

namespace {

// Note [errors carry their parts]
// A message is made once, where the error is thrown, from parts the error keeps. A layer that
// reports the error in its own words (startup.cpp names GPUMEM_LIMIT; python/gpumem/settings/limits.py
// shows the spec as Python's messages do) reads the parts, so a change of wording here cannot
// break what it says, and a quoted spec that happens to hold ": " cannot cut the reason short.
std::string limit_spec_message(const LimitSpecParts& p) {
  std::string out = "gpumem: bad " + p.setting;
  if (p.spec) out += " " + shown(*p.spec);
  out += ": " + p.reason;
  if (!p.forms.empty()) out += ". Accepted forms: " + p.forms;
  if (!p.next.empty()) out += ". " + p.next;
  return out;
}

}  // namespace

LimitSpecError::LimitSpecError(LimitSpecParts parts)
    : std::invalid_argument(limit_spec_message(parts)), parts_(std::move(parts)) {}

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

constexpr const char* kNeighboursAdvice =
    "The other processes sharing this GPU leave this process too little: their floors and live tensors, named "
    "below. The gpumem limit was not reached, so raising it cannot help: lower or drop their floors (GPUMEM_FLOOR, "
    "gpumem.set_limit(floor=...)), end one of them, or use less memory.";

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
  const std::string resuming =
      i.resuming == 0 ? "" : "gpumem: resuming a paused region needs its " + native_size(i.resuming) +
                                 " paused mapped again; it stays paused, its tensors keeping their addresses (and "
                                 "backup): resume it again once that much is free. ";
  return resuming + "CUDA out of memory. Tried to allocate " + tried + ". GPU " + std::to_string(i.device) +
         " has a total capacity of " + native_size(i.device_total) + " of which " + native_size(i.device_free) +
         " is free. " + allowed + "Of the allocated memory " + native_size(i.allocated) +
         " is allocated by PyTorch, and " + native_size(i.reserved - std::min(i.reserved, i.allocated)) +
         " is reserved by PyTorch but unallocated. gpumem: " + oom_kind_name(i.kind) + ", under a limit of " +
         native_size(i.limit) +
         (i.process_scope ? " on the whole process, of which " + native_size(i.outside) +
                                " is held outside PyTorch's allocator (the CUDA context, libraries)"
                          : std::string()) +
         "; the largest free cached block is " + native_size(i.largest_free_block) + ". " +
         (i.neighbours ? kNeighboursAdvice : advice(i.kind)) + i.sharing;
}

}  // namespace

OutOfMemoryError::OutOfMemoryError(const OomInfo& info) : info_(info), message_(oom_message(info)) {}

}  // namespace gpumem
