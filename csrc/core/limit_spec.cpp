// Parsing of limit specs and GPUMEM_LIMIT lists; the grammar is in limit_spec.h.
//
// Numbers are scanned by hand and kept as decimal text, so "1.5GB" and "33.3%" come out exactly
// floor(value * unit) with no rounding through double, and every overflow of size_t is caught.
#include "core/limit_spec.h"

#include <limits>
#include <set>

#include "core/errors.h"

namespace gpumem {

const char* const kLimitForms =
    "an integer byte count (\"1073741824\"), a size with a binary unit (\"4GB\", \"4 GB\", "
    "\"1.5GB\", \"512MB\", \"750MiB\", \"2TB\", \"4G\"; 1 KB = 1024 bytes), a percentage of the "
    "device (\"50%\"), a fraction of the device (\"0.5\"), or \"none\"";

namespace {

constexpr std::size_t kMaxBytes = std::numeric_limits<std::size_t>::max();
constexpr const char* kListForms = "SPEC or DEVICE:SPEC[,DEVICE:SPEC...]";

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

char to_lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (to_lower(a[i]) != to_lower(b[i])) return false;
  }
  return true;
}

std::string quoted(std::string_view s) { return shown(s); }

// `text` is quoted as the user gave it, white space included, so they can find it (shown() escapes
// control characters and cuts a long one short).
[[noreturn]] void reject(std::string_view text, const std::string& reason) {
  throw LimitSpecError({"limit", std::string(text), reason, kLimitForms, ""});
}

// ---- checked arithmetic on size_t -----------------------------------------------------------

bool checked_mul(std::size_t a, std::size_t b, std::size_t* out) {
  if (a != 0 && b > kMaxBytes / a) return false;
  *out = a * b;
  return true;
}

bool checked_add(std::size_t a, std::size_t b, std::size_t* out) {
  if (b > kMaxBytes - a) return false;
  *out = a + b;
  return true;
}

// ---- decimal numbers ------------------------------------------------------------------------

// A number as written: its value is digits / 10^(digits.size() - int_len).
// Invariant: digits holds only '0'..'9' and at least one of them.
struct Decimal {
  std::string digits;
  std::size_t int_len = 0;
  bool has_point = false;

  std::string_view whole() const { return std::string_view(digits).substr(0, int_len); }
  std::string_view fraction() const { return std::string_view(digits).substr(int_len); }
};

// false when the digits do not fit in size_t.
bool parse_whole(std::string_view digits, std::size_t* out) {
  std::size_t value = 0;
  for (char c : digits) {
    if (!checked_mul(value, 10, &value)) return false;
    if (!checked_add(value, static_cast<std::size_t>(c - '0'), &value)) return false;
  }
  *out = value;
  return true;
}

// floor(0.d1d2...dk * m), folded from the last digit inward: y <- floor((d * m + y) / 10) is
// exact by the nested-floor identity, and splitting m = 10q + r keeps every term below m.
std::size_t floor_fraction_times(std::string_view digits, std::size_t m) {
  const std::size_t q = m / 10;
  const std::size_t r = m % 10;
  std::size_t y = 0;
  for (auto it = digits.rbegin(); it != digits.rend(); ++it) {
    const std::size_t d = static_cast<std::size_t>(*it - '0');
    y = d * q + y / 10 + (d * r + y % 10) / 10;
  }
  return y;
}

// floor(n * m); false when it does not fit in size_t.
bool floor_times(const Decimal& n, std::size_t m, std::size_t* out) {
  std::size_t whole = 0;
  if (!parse_whole(n.whole(), &whole)) return false;
  if (!checked_mul(whole, m, &whole)) return false;
  return checked_add(whole, floor_fraction_times(n.fraction(), m), out);
}

bool all_zero(std::string_view digits) {
  return digits.find_first_not_of('0') == std::string_view::npos;
}

bool is_zero(const Decimal& n) { return all_zero(n.digits); }

bool exceeds(const Decimal& n, std::size_t bound) {
  std::size_t whole = 0;
  if (!parse_whole(n.whole(), &whole) || whole > bound) return true;
  return whole == bound && !all_zero(n.fraction());
}

// n / 100, by moving the point two places left.
Decimal percent_to_fraction(const Decimal& n) {
  if (n.int_len >= 2) return {n.digits, n.int_len - 2, true};
  return {std::string(2 - n.int_len, '0') + n.digits, 0, true};
}

Decimal parse_decimal(std::string_view text, std::string_view number) {
  Decimal n;
  for (char c : number) {
    if (c != '.') {
      n.digits.push_back(c);
    } else if (n.has_point) {
      reject(text, "the number " + quoted(number) + " has more than one \".\"");
    } else {
      n.has_point = true;
      n.int_len = n.digits.size();
    }
  }
  if (n.digits.empty()) reject(text, "it does not start with a number");
  if (!n.has_point) n.int_len = n.digits.size();
  return n;
}

// ---- units ----------------------------------------------------------------------------------

struct Unit {
  const char* name;
  int shift;  // the unit is 2^shift bytes
};

constexpr Unit kUnits[] = {
    {"b", 0},   {"k", 10},   {"kb", 10}, {"kib", 10}, {"m", 20},  {"mb", 20},  {"mib", 20},
    {"g", 30},  {"gb", 30},  {"gib", 30}, {"t", 40},  {"tb", 40}, {"tib", 40},
};

std::size_t unit_bytes(std::string_view text, std::string_view unit) {
  for (const Unit& u : kUnits) {
    if (iequals(unit, u.name)) return std::size_t{1} << u.shift;
  }
  reject(text, "unknown unit " + quoted(unit));
}

// ---- one spec -------------------------------------------------------------------------------

// floor(n * unit), refusing what does not fit in size_t.
std::size_t scaled_bytes(std::string_view text, const Decimal& n, std::size_t unit) {
  std::size_t bytes = 0;
  if (!floor_times(n, unit, &bytes)) {
    reject(text, "it is more than the largest byte count, " + std::to_string(kMaxBytes) + " bytes");
  }
  return bytes;
}

std::size_t percent_bytes(std::string_view text, const Decimal& n, std::size_t device_total) {
  if (is_zero(n) || exceeds(n, 100)) reject(text, "a percentage must be above 0 and at most 100");
  return scaled_bytes(text, percent_to_fraction(n), device_total);
}

std::size_t fraction_bytes(std::string_view text, const Decimal& n, std::size_t device_total) {
  if (is_zero(n) || exceeds(n, 1)) {
    reject(text, "a number with a \".\" and no unit is a fraction of the device, which must be "
                 "above 0 and at most 1 (add a unit for a size, e.g. \"1.5GB\")");
  }
  return scaled_bytes(text, n, device_total);
}

// Bytes for a number and its (possibly empty) unit, before the range checks.
std::size_t spec_bytes(std::string_view text, const Decimal& n, std::string_view unit,
                       std::size_t device_total) {
  if (unit == "%") return percent_bytes(text, n, device_total);
  if (!unit.empty()) return scaled_bytes(text, n, unit_bytes(text, unit));
  if (n.has_point) return fraction_bytes(text, n, device_total);
  return scaled_bytes(text, n, 1);
}

void check_range(std::string_view text, std::size_t bytes, std::size_t device_total) {
  if (bytes == 0) {
    reject(text, "it comes to 0 bytes; a limit must be at least one byte (use \"none\" for no "
                 "limit)");
  }
  if (bytes > device_total) {
    reject(text, "it comes to " + format_bytes(bytes) + ", more than the device total of " +
                     format_bytes(device_total));
  }
}

// ---- GPUMEM_LIMIT lists ---------------------------------------------------------------------

[[noreturn]] void reject_list(std::string_view text, const std::string& reason) {
  throw LimitSpecError({"limit list", std::string(text), reason, std::string(kListForms) + ", where SPEC is " + kLimitForms, ""});
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  for (std::size_t start = 0;;) {
    const std::size_t end = s.find(sep, start);
    parts.push_back(s.substr(start, end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

int parse_device(std::string_view text, std::string_view item, std::string_view device) {
  std::size_t value = 0;
  const bool digits_only =
      !device.empty() && device.find_first_not_of("0123456789") == std::string_view::npos;
  if (!digits_only || !parse_whole(device, &value) ||
      value > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    reject_list(text, "in item " + quoted(item) + ", the device " + quoted(device) +
                          " is not a non-negative integer");
  }
  return static_cast<int>(value);
}

LimitAssignment parse_assignment(std::string_view text, std::string_view item) {
  if (item.empty()) reject_list(text, "an item is empty (look for a doubled or trailing \",\")");
  const std::size_t colon = item.find(':');
  if (colon == std::string_view::npos) return {-1, std::string(item)};
  const std::string_view spec = trim(item.substr(colon + 1));
  if (spec.empty()) reject_list(text, "item " + quoted(item) + " has no spec after the \":\"");
  return {parse_device(text, item, trim(item.substr(0, colon))), std::string(spec)};
}

// A spec for every device is all or nothing: combined with others, which one wins is unclear.
void check_shape(std::string_view text, const std::vector<LimitAssignment>& list) {
  std::set<int> seen;
  for (const LimitAssignment& a : list) {
    if (a.device == -1 && list.size() > 1) {
      reject_list(text, "item " + quoted(a.spec) +
                            " applies to every device and cannot be combined with other items");
    }
    if (!seen.insert(a.device).second) {
      reject_list(text, "device " + std::to_string(a.device) + " is listed twice");
    }
  }
}

}  // namespace

std::optional<std::size_t> parse_limit(std::string_view text, std::size_t device_total) {
  const std::string_view body = trim(text);
  if (body.empty()) reject(text, "it is empty");
  if (iequals(body, "none")) return std::nullopt;
  if (body.front() == '-') reject(text, "a limit cannot be negative");
  const std::size_t end = body.find_first_not_of("0123456789.");
  const Decimal n = parse_decimal(text, body.substr(0, end));
  const std::string_view unit = end == std::string_view::npos ? "" : trim(body.substr(end));
  const std::size_t bytes = spec_bytes(text, n, unit, device_total);
  check_range(text, bytes, device_total);
  return bytes;
}

std::vector<LimitAssignment> parse_limit_assignments(std::string_view text) {
  const std::string_view body = trim(text);
  if (body.empty()) reject_list(text, "it is empty");
  std::vector<LimitAssignment> list;
  for (std::string_view item : split(body, ',')) list.push_back(parse_assignment(text, trim(item)));
  check_shape(text, list);
  return list;
}

}  // namespace gpumem
