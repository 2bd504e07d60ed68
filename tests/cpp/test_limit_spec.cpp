// The limit grammar of limit_spec.h, form by form: what each good form comes to in bytes, and
// that each bad form is refused with a message that quotes it.
#include <catch2/catch.hpp>

#include <cstddef>
#include <limits>
#include <string>

#include "core/errors.h"
#include "core/limit_spec.h"

using gpumem::LimitAssignment;
using gpumem::LimitSpecError;
using gpumem::parse_limit;
using gpumem::parse_limit_assignments;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t TiB = std::size_t{1} << 40;
constexpr std::size_t k80GiB = 80 * GiB;  // an H100's total, large enough for every size below
constexpr std::size_t kHuge = 8 * TiB;
constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();

std::size_t bytes(const char* text, std::size_t device_total = kHuge) {
  return parse_limit(text, device_total).value();
}

// The message must quote the text exactly as given, so the user can find it.
std::string quoted(const std::string& text) { return "\"" + text + "\""; }

void require_refused(const std::string& text, std::size_t device_total = k80GiB) {
  REQUIRE_THROWS_AS(parse_limit(text, device_total), LimitSpecError);
  REQUIRE_THROWS_WITH(parse_limit(text, device_total), Catch::Contains(quoted(text)));
}

void require_list_refused(const std::string& text, const std::string& item) {
  REQUIRE_THROWS_AS(parse_limit_assignments(text), LimitSpecError);
  REQUIRE_THROWS_WITH(parse_limit_assignments(text), Catch::Contains(quoted(text)));
  REQUIRE_THROWS_WITH(parse_limit_assignments(text), Catch::Contains(item));
  REQUIRE_THROWS_WITH(parse_limit_assignments(text), Catch::Contains("DEVICE:SPEC"));
}

}  // namespace

// ---- good forms -------------------------------------------------------------------------------

TEST_CASE("plain digits are a byte count", "[limit_spec]") {
  REQUIRE(bytes("1073741824") == GiB);
  REQUIRE(bytes("1") == 1);
  REQUIRE(bytes("000512") == 512);
}

TEST_CASE("a size with a unit is that many binary units", "[limit_spec]") {
  REQUIRE(bytes("4GB") == 4 * GiB);
  REQUIRE(bytes("512MB") == 512 * MiB);
  REQUIRE(bytes("750MiB") == 750 * MiB);
  REQUIRE(bytes("2TB") == 2 * TiB);
  REQUIRE(bytes("4G") == 4 * GiB);
}

TEST_CASE("every unit spelling has its binary value", "[limit_spec]") {
  REQUIRE(bytes("7B") == 7);
  REQUIRE(bytes("3K") == 3 * KiB);
  REQUIRE(bytes("3KB") == 3 * KiB);
  REQUIRE(bytes("3KiB") == 3 * KiB);
  REQUIRE(bytes("3M") == 3 * MiB);
  REQUIRE(bytes("3MB") == 3 * MiB);
  REQUIRE(bytes("3MiB") == 3 * MiB);
  REQUIRE(bytes("3G") == 3 * GiB);
  REQUIRE(bytes("3GB") == 3 * GiB);
  REQUIRE(bytes("3GiB") == 3 * GiB);
  REQUIRE(bytes("3T") == 3 * TiB);
  REQUIRE(bytes("3TB") == 3 * TiB);
  REQUIRE(bytes("3TiB") == 3 * TiB);
}

TEST_CASE("a decimal size is floored to whole bytes", "[limit_spec]") {
  REQUIRE(bytes("1.5GB") == GiB + GiB / 2);
  REQUIRE(bytes("0.3K") == 307);  // 307.2
  REQUIRE(bytes("1.5B") == 1);
  REQUIRE(bytes("1.0000001GB") == GiB + 107);  // 107.3741824 past 1 GiB
}

TEST_CASE("units and none are case-insensitive", "[limit_spec]") {
  REQUIRE(bytes("4gb") == 4 * GiB);
  REQUIRE(bytes("4Gb") == 4 * GiB);
  REQUIRE(bytes("4gib") == 4 * GiB);
  REQUIRE(bytes("4GIB") == 4 * GiB);
  REQUIRE(bytes("4g") == 4 * GiB);
  REQUIRE_FALSE(parse_limit("NONE", k80GiB).has_value());
  REQUIRE_FALSE(parse_limit("None", k80GiB).has_value());
}

TEST_CASE("white space around the spec and before the unit is ignored", "[limit_spec]") {
  REQUIRE(bytes("4 GB") == 4 * GiB);
  REQUIRE(bytes("4   GB") == 4 * GiB);
  REQUIRE(bytes("  4GB\t") == 4 * GiB);
  REQUIRE(bytes("\n1073741824 ") == GiB);
  REQUIRE(bytes(" 50 % ", k80GiB) == 40 * GiB);
  REQUIRE_FALSE(parse_limit("  none  ", k80GiB).has_value());
}

TEST_CASE("none means no limit", "[limit_spec]") {
  REQUIRE(parse_limit("none", k80GiB) == std::nullopt);
}

TEST_CASE("a percentage is of the device total, floored", "[limit_spec]") {
  REQUIRE(bytes("50%", k80GiB) == 40 * GiB);
  REQUIRE(bytes("12.5%", k80GiB) == 10 * GiB);
  REQUIRE(bytes("3%", k80GiB) == 2576980377);    // 2576980377.6
  REQUIRE(bytes("33.3%", k80GiB) == 28604482191);  // 28604482191.36
  REQUIRE(bytes("0.5 %", 1000) == 5);
}

TEST_CASE("a percentage of 100 is the whole device", "[limit_spec]") {
  REQUIRE(bytes("100%", k80GiB) == k80GiB);
  REQUIRE(bytes("100.000%", k80GiB) == k80GiB);
}

TEST_CASE("a number with a point and no unit is a fraction of the device", "[limit_spec]") {
  REQUIRE(bytes("0.5", k80GiB) == 40 * GiB);
  REQUIRE(bytes("0.1", k80GiB) == 8 * GiB);
  REQUIRE(bytes(".25", k80GiB) == 20 * GiB);
  REQUIRE(bytes("0.333", 1000) == 333);
  REQUIRE(bytes("0.3333", 1000) == 333);
}

TEST_CASE("a fraction of 1 is the whole device", "[limit_spec]") {
  REQUIRE(bytes("1.0", k80GiB) == k80GiB);
  REQUIRE(bytes("1.", k80GiB) == k80GiB);
}

TEST_CASE("a limit exactly at the device total is accepted", "[limit_spec]") {
  REQUIRE(bytes("80GB", k80GiB) == k80GiB);
  REQUIRE(bytes("85899345920", k80GiB) == k80GiB);
  REQUIRE(bytes("18446744073709551615", kMax) == kMax);
}

TEST_CASE("sizes up to the largest size_t are exact", "[limit_spec]") {
  REQUIRE(bytes("16777215.5TiB", kMax) == kMax - TiB / 2 + 1);  // 2^64 - 2^40 + 2^39
  REQUIRE(bytes("16777215.999999999999999999999TiB", kMax) == kMax);
}

// ---- bad forms --------------------------------------------------------------------------------

TEST_CASE("a limit one byte over the device total is refused", "[limit_spec]") {
  require_refused("85899345921");
  require_refused("81GB");
  REQUIRE_THROWS_WITH(parse_limit("81GB", k80GiB), Catch::Contains("device total"));
}

TEST_CASE("empty text is refused", "[limit_spec]") {
  require_refused("");
  require_refused("   ");
  REQUIRE_THROWS_WITH(parse_limit("", k80GiB), Catch::Contains("empty"));
}

TEST_CASE("an unknown unit is refused and named", "[limit_spec]") {
  require_refused("4XB");
  REQUIRE_THROWS_WITH(parse_limit("4XB", k80GiB), Catch::Contains("unknown unit \"XB\""));
  require_refused("4 G B");
  require_refused("4GB extra");
  require_refused("4PB");
}

TEST_CASE("a negative limit is refused", "[limit_spec]") {
  require_refused("-1GB");
  require_refused("-1");
  require_refused("-50%");
  REQUIRE_THROWS_WITH(parse_limit("-1GB", k80GiB), Catch::Contains("negative"));
}

TEST_CASE("a percentage above 100 is refused", "[limit_spec]") {
  require_refused("101%");
  require_refused("100.001%");
  require_refused("99999999999999999999999%");
  REQUIRE_THROWS_WITH(parse_limit("101%", k80GiB), Catch::Contains("percentage"));
}

TEST_CASE("a percentage of 0 is refused", "[limit_spec]") {
  require_refused("0%");
  require_refused("0.0%");
}

TEST_CASE("a fraction above 1 is refused", "[limit_spec]") {
  require_refused("1.5");
  require_refused("1.0001");
  require_refused("2.");
  REQUIRE_THROWS_WITH(parse_limit("1.5", k80GiB), Catch::Contains("fraction"));
}

TEST_CASE("a fraction of 0 is refused", "[limit_spec]") {
  require_refused("0.0");
  require_refused(".0");
}

TEST_CASE("a limit that comes to 0 bytes is refused", "[limit_spec]") {
  require_refused("0");
  require_refused("0GB");
  require_refused("0.1B");
  require_refused("0.0000000001%", 1000);
  require_refused("0.000000000000000000001TB");
  REQUIRE_THROWS_WITH(parse_limit("0", k80GiB), Catch::Contains("0 bytes"));
}

TEST_CASE("a size beyond size_t is refused", "[limit_spec]") {
  require_refused("18446744073709551616", kMax);
  require_refused("16777216TiB", kMax);
  require_refused("99999999999999999999999999GB", kMax);
}

TEST_CASE("nan and inf are refused", "[limit_spec]") {
  require_refused("nan");
  require_refused("NaN");
  require_refused("inf");
  require_refused("infGB");
}

TEST_CASE("anything but plain decimal digits is refused", "[limit_spec]") {
  require_refused("+1GB");
  require_refused("1e9");
  require_refused("0x10");
  require_refused("1.2.3");
  require_refused("1..5GB");
  require_refused(".");
  require_refused("GB");
  require_refused("%");
}

TEST_CASE("the message quotes untrimmed text and lists the accepted forms", "[limit_spec]") {
  REQUIRE_THROWS_WITH(parse_limit("  4XB ", k80GiB), Catch::Contains("\"  4XB \""));
  REQUIRE_THROWS_WITH(parse_limit("4XB", k80GiB), Catch::Contains(gpumem::kLimitForms));
}

TEST_CASE("the message escapes control characters, so a NUL does not cut it short", "[limit_spec]") {
  const std::string text("4G\0B\n", 5);
  REQUIRE_THROWS_WITH(parse_limit(text, k80GiB), Catch::Contains("\"4G\\x00B\\n\"") && Catch::Contains(gpumem::kLimitForms));
}

TEST_CASE("the message cuts a long value short and says how long it was", "[limit_spec]") {
  const std::string text = "4" + std::string(10'000'000, 'X');
  try {
    parse_limit(text, k80GiB);
    FAIL("accepted");
  } catch (const LimitSpecError& e) {
    const std::string message = e.what();
    REQUIRE(message.size() < 1000);
    REQUIRE_THAT(message, Catch::Contains("\"4" + std::string(gpumem::kShownBytes - 1, 'X') + "\"... (10000001 bytes in all)"));
  }
}

TEST_CASE("shown keeps UTF-8 and escapes bytes that are not UTF-8", "[limit_spec]") {
  REQUIRE(gpumem::shown("4 Гб") == "\"4 Гб\"");
  REQUIRE(gpumem::shown("a\xff\xc3") == "\"a\\xff\\xc3\"");
  REQUIRE(gpumem::shown("\xed\xa0\x80") == "\"\\xed\\xa0\\x80\"");  // a UTF-16 surrogate
  REQUIRE(gpumem::shown("say \"hi\"") == "\"say \\\"hi\\\"\"");
}

TEST_CASE("the error carries the spec, the reason alone and the forms, and its message is made of them", "[limit_spec]") {
  try {
    parse_limit(" 4XB", k80GiB);
    FAIL("accepted");
  } catch (const LimitSpecError& e) {
    REQUIRE(e.setting() == "limit");
    REQUIRE(e.spec() == std::optional<std::string>(" 4XB"));
    REQUIRE(e.reason() == "unknown unit \"XB\"");
    REQUIRE(e.forms() == gpumem::kLimitForms);
    REQUIRE(std::string(e.what()) ==
            "gpumem: bad limit \" 4XB\": unknown unit \"XB\". Accepted forms: " + std::string(gpumem::kLimitForms));
  }
}

TEST_CASE("an empty spec is still quoted: it is text the user gave", "[limit_spec]") {
  REQUIRE_THROWS_WITH(parse_limit("", k80GiB), Catch::StartsWith("gpumem: bad limit \"\": it is empty. Accepted forms: "));
}

TEST_CASE("an error about a value with no text leaves the quoted spec out", "[limit_spec]") {
  const LimitSpecError e({"limit", std::nullopt, "9.00 GiB is above device 0's total of 8.00 GiB", "", ""});
  REQUIRE(std::string(e.what()) == "gpumem: bad limit: 9.00 GiB is above device 0's total of 8.00 GiB");
}

// ---- GPUMEM_LIMIT lists -----------------------------------------------------------------------

TEST_CASE("a single spec applies to every device", "[limit_spec]") {
  const auto list = parse_limit_assignments("4GB");
  REQUIRE(list.size() == 1);
  REQUIRE(list[0].device == -1);
  REQUIRE(list[0].spec == "4GB");
}

TEST_CASE("per-device specs give one entry per device in order", "[limit_spec]") {
  const auto list = parse_limit_assignments("0:4GB,1:8GB");
  REQUIRE(list.size() == 2);
  REQUIRE(list[0].device == 0);
  REQUIRE(list[0].spec == "4GB");
  REQUIRE(list[1].device == 1);
  REQUIRE(list[1].spec == "8GB");
}

TEST_CASE("white space around list items is ignored", "[limit_spec]") {
  const auto list = parse_limit_assignments("  3 : 4 GB ,  1:50%  ");
  REQUIRE(list.size() == 2);
  REQUIRE(list[0].device == 3);
  REQUIRE(list[0].spec == "4 GB");
  REQUIRE(list[1].device == 1);
  REQUIRE(list[1].spec == "50%");
}

TEST_CASE("list specs are passed through unparsed", "[limit_spec]") {
  REQUIRE(parse_limit_assignments("4XB")[0].spec == "4XB");
  REQUIRE(parse_limit_assignments("0:none")[0].spec == "none");
}

TEST_CASE("an empty list is refused", "[limit_spec]") {
  REQUIRE_THROWS_AS(parse_limit_assignments(""), LimitSpecError);
  REQUIRE_THROWS_WITH(parse_limit_assignments("  "), Catch::Contains("\"  \""));
  REQUIRE_THROWS_WITH(parse_limit_assignments(""), Catch::Contains("DEVICE:SPEC"));
}

TEST_CASE("an empty list item is refused", "[limit_spec]") {
  require_list_refused("0:4GB,", "empty");
  require_list_refused("0:4GB,,1:8GB", "empty");
  require_list_refused(",0:4GB", "empty");
}

TEST_CASE("a device that is not a non-negative integer is refused", "[limit_spec]") {
  require_list_refused("x:4GB", "\"x:4GB\"");
  require_list_refused("0:4GB,-1:8GB", "\"-1:8GB\"");
  require_list_refused("+1:4GB", "\"+1:4GB\"");
  require_list_refused(":4GB", "\":4GB\"");
  require_list_refused("99999999999:4GB", "\"99999999999:4GB\"");
}

TEST_CASE("a device with no spec is refused", "[limit_spec]") {
  require_list_refused("0:4GB,1:", "\"1:\"");
}

TEST_CASE("a device listed twice is refused", "[limit_spec]") {
  require_list_refused("0:4GB,1:2GB,0:8GB", "device 0");
}

TEST_CASE("an all-devices spec mixed with per-device specs is refused", "[limit_spec]") {
  require_list_refused("4GB,1:8GB", "\"4GB\"");
  require_list_refused("1:8GB,4GB", "\"4GB\"");
  require_list_refused("4GB,8GB", "\"4GB\"");
}
