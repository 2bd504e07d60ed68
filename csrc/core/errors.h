// Typed errors of the core. Every message names the bad value or the numbers behind a refusal and
// says what to change.
#pragma once

#include <cstddef>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace gpumem {

// A limit spec (or another user setting) that does not parse or is out of range. The setting it
// was meant for is left unchanged.
//
// The error carries its parts, so that a layer that names the setting its own way (GPUMEM_LIMIT,
// the Python package) takes the reason and the forms as they are and never parses what() (see
// Note [errors carry their parts] in errors.cpp). what() is made from them once:
//   gpumem: bad SETTING "SPEC": REASON. Accepted forms: FORMS. NEXT
// with the quoted spec left out when there is none, and each of the last two parts when it is "".
struct LimitSpecParts {
  std::string setting;              // what the value was for: "limit", "GPUMEM_LIMIT", "release threshold"
  std::optional<std::string> spec;  // the value as the user gave it, not yet shown(); none if there was no text
  std::string reason;               // why it was refused, alone: no "gpumem: ", spec, forms or final "."
  std::string forms;                // the accepted forms; "" when no list of forms applies
  std::string next;                 // what to do, a sentence ending in "."; "" when the forms say it
};

class LimitSpecError : public std::invalid_argument {
 public:
  explicit LimitSpecError(LimitSpecParts parts);
  const LimitSpecParts& parts() const noexcept { return parts_; }
  const std::string& setting() const noexcept { return parts_.setting; }
  const std::optional<std::string>& spec() const noexcept { return parts_.spec; }
  const std::string& reason() const noexcept { return parts_.reason; }
  const std::string& forms() const noexcept { return parts_.forms; }

 private:
  LimitSpecParts parts_;
};

// A device index that the backend does not have.
class DeviceError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// Why a request could not be served; the OOM message says which.
enum class OomKind {
  kOverLimit,      // allocated bytes plus the request exceed the limit
  kDeviceFull,     // under the limit, but the device itself had no memory left
  kFragmentation,  // within the limit, but no cached block is large enough and no segment fits
};

const char* oom_kind_name(OomKind kind);

// Everything known at the moment a request failed.
struct OomInfo {
  int device = 0;
  OomKind kind = OomKind::kOverLimit;
  std::size_t requested = 0;   // bytes asked for, before rounding
  std::size_t allocated = 0;   // bytes in allocated blocks
  std::size_t reserved = 0;    // bytes in segments
  std::size_t limit = 0;       // the cap on reserved bytes (on reserved + outside under process scope)
  bool process_scope = false;  // the limit bounds the whole process (LimitScope::kProcess)
  std::size_t outside = 0;     // the process's memory outside the allocator, as last measured
  std::size_t device_free = 0;
  std::size_t device_total = 0;
  std::size_t largest_free_block = 0;
  std::string sharing;  // who else shares the GPU and holds what (sharing/member.cpp); "" if none
  bool neighbours = false;  // the others sharing the GPU left too little; the limit itself had room
  std::size_t resuming = 0;  // a paused region's bytes that could not be mapped again (core/pause.cpp); 0 for a request
};

// Derives from std::bad_alloc so generic C++ code treats it as an allocation failure.
class OutOfMemoryError : public std::bad_alloc {
 public:
  explicit OutOfMemoryError(const OomInfo& info);
  const char* what() const noexcept override { return message_.c_str(); }
  const OomInfo& info() const noexcept { return info_; }

 private:
  OomInfo info_;
  std::string message_;
};

// Runs f() where nothing may be thrown (destructors, deleters, reports about memory that has
// already changed hands): what f throws is dropped, since there is no caller left to tell.
template <class F>
void quietly(F&& f) noexcept {
  try {
    f();
  } catch (...) {
  }
}

// `text` as a message echoes a value the user gave: in double quotes, with control characters and
// bytes that are not UTF-8 escaped (\n, \x00), and cut after kShownBytes with its length said, so
// that a NUL does not end the message early and a 10 MB value stays a short line. The one rule for
// the user's text in a message: python/gpumem/settings/echo.py's shown() cuts after as many characters
// (_C.SHOWN_LENGTH; tests/python/test_limit_grammar.py holds the two equal).
constexpr std::size_t kShownBytes = 64;
std::string shown(std::string_view text);

// "4.00 GiB", "512 bytes": the form every message uses.
std::string format_bytes(std::size_t bytes);

}  // namespace gpumem
