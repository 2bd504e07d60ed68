// The limit grammar, shared by set_limit, GPUMEM_LIMIT and the command line.
//
//   spec      := "none" | bytes | size unit | percent | fraction
//   bytes     := digits                      e.g. "1073741824"
//   size unit := number [space] unit         e.g. "4GB", "4 GB", "1.5GB", "750MiB", "4G"
//   unit      := B | K | KB | KiB | M | MB | MiB | G | GB | GiB | T | TB | TiB (any case; binary)
//   percent   := number [space] "%"          e.g. "50%", of the device total, in (0, 100]
//   fraction  := number with a "."           e.g. "0.5", of the device total, in (0, 1]
//
// Leading and trailing white space is ignored. The result must be at least one byte and at most
// the device total. Anything else throws LimitSpecError naming the text and the accepted forms.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gpumem {

// Bytes for `text` on a device of `device_total` bytes; std::nullopt for "none" (no limit).
std::optional<std::size_t> parse_limit(std::string_view text, std::size_t device_total);

// One entry of a GPUMEM_LIMIT value: "4GB" applies to every device (device == -1);
// "0:4GB,1:8GB" gives one spec per device. Specs are returned unparsed (they need the device
// total); the device numbers and the list's shape are checked here.
struct LimitAssignment {
  int device = -1;
  std::string spec;
};
std::vector<LimitAssignment> parse_limit_assignments(std::string_view text);

// The accepted forms, for error messages and --help.
extern const char* const kLimitForms;

}  // namespace gpumem
