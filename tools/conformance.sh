#!/usr/bin/env bash
# The backend conformance suite on the CUDA backend (tests/cuda/test_cuda_conformance.cpp): builds it
# in $CONFORMANCE_BUILD_DIR (default build/gpu) with CMake, Ninja and Catch2 v2's single header, and
# runs it. Needs a GPU to pass. tools/gpu_check.sh runs it with PART=1 or CONFORMANCE=1.
#   bash tools/conformance.sh
# Exit status:
#   0  built, and every test passed
#   1  the build or a test failed
#   3  not built: CMake, Ninja or Catch2's catch2/catch.hpp is missing; one line says which and where
#      it looked. Nothing was tested, nothing failed.
# Catch2 is found where Debian's catch2 package (tools/setup.sh installs it) puts catch2/catch.hpp
# (`dpkg -L catch2`: /usr/include/catch2/catch.hpp), or in /usr/local/include; CATCH2_INCLUDE=DIR
# names the directory holding catch2/catch.hpp instead. Catch2 v3 has no catch2/catch.hpp.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${CONFORMANCE_BUILD_DIR:-build/gpu}

not_built() {
  echo "conformance suite NOT BUILT: $*"
  exit 3
}

# The directories where catch2/catch.hpp is looked for, in order.
catch2_candidates() {
  if [ -n "${CATCH2_INCLUDE:-}" ]; then
    echo "$CATCH2_INCLUDE"
    return
  fi
  dpkg -L catch2 2>/dev/null | sed -n 's|/catch2/catch\.hpp$||p'
  echo /usr/include
  echo /usr/local/include
}

for tool in cmake ninja; do
  command -v "$tool" >/dev/null || not_built "no $tool on PATH (tools/setup.sh installs it)"
done
include=""
looked=()
while read -r dir; do
  looked+=("$dir")
  if [ -f "$dir/catch2/catch.hpp" ]; then
    include=$dir
    break
  fi
done < <(catch2_candidates)
[ -n "$include" ] ||
  not_built "no catch2/catch.hpp (Catch2 v2) in ${looked[*]}; install Debian's catch2 (tools/setup.sh) or set CATCH2_INCLUDE to the directory holding catch2/catch.hpp"

echo "conformance: Catch2 from $include/catch2/catch.hpp"
cmake -S . -B "$build" -G Ninja -DGPUMEM_TORCH_TESTS=OFF -DGPUMEM_BENCHMARKS=OFF -DGPUMEM_CATCH2_INCLUDE="$include" ||
  exit 1
ninja -C "$build" gpumem_cuda_conformance || exit 1
# Catch2's own status counts the failures: map it, so that 3 failures never read as "not built".
"$build/gpumem_cuda_conformance" || exit 1
