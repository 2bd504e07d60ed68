// Turns the core's typed errors into the c10 errors torch's Python layer maps: LimitSpecError and
// DeviceError -> c10::ValueError (ValueError), OutOfMemoryError -> c10::OutOfMemoryError
// (torch.OutOfMemoryError), anything else -> c10::Error (RuntimeError). c10 errors pass through.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <stdexcept>

#include "core/errors.h"

namespace gpumem {

// Call from inside a catch block.
[[noreturn]] inline void rethrow_as_c10_error() {
  try {
    throw;
  } catch (const c10::Error&) {
    throw;
  } catch (const OutOfMemoryError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const LimitSpecError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const DeviceError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  } catch (...) {
    TORCH_CHECK(false, "gpumem: unknown error");
  }
}

// Runs f(), translating what it throws.
template <class F>
decltype(auto) with_c10_errors(F&& f) {
  try {
    return f();
  } catch (...) {
    rethrow_as_c10_error();
  }
}

}  // namespace gpumem
