// Settings the randomized tests read from the environment (GPUMEM_PROPERTY_OPS, GPUMEM_PROPERTY_SEED,
// GPUMEM_THREAD_OPS), so sanitizer builds can run them shorter and a failure can be rerun by seed.
#pragma once

#include <cstdint>
#include <cstdlib>

namespace gpumem_test {

inline std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* text = std::getenv(name);
  return text && *text ? std::strtoull(text, nullptr, 0) : fallback;
}

}  // namespace gpumem_test
