#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what is missing, then runs
#   1. the core's Catch2 tests (CTest), in a normal build,
#   2. the same under AddressSanitizer + UndefinedBehaviorSanitizer, with the invariant checker
#      compiled into every operation,
#   3. the threaded tests under ThreadSanitizer (the sanitized build of 2 runs them with the invariant
#      checker compiled in, where a lane checks what it owns while the others run),
#   4. the Python tests (pytest) against gpumem installed with pip; GPU tests skip without a GPU,
#   5. the wheel: built here, installed in a fresh environment without a compiler, used there
#      (tools/wheel_check.sh; a few minutes, most of them compiling),
#   6. and 7. under the oldest and the newest torch gpumem supports (tools/torch-versions), each in a
#      virtual environment of its own: the torch adapter's tests, the wheel check and the Python suite
#      (tools/torch_version_check.sh; the first run on a machine downloads each release).
# Ends with one line per torch release run. TORCH_RELEASES (default "oldest newest") picks the
# releases of 6 and 7; empty skips them. Exits non-zero if any suite fails or runs no test.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1

PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
failed=0
passed=0

suite() {  # suite NAME COMMAND...
  local name=$1
  shift
  echo
  echo "==== $name"
  if "$@"; then
    passed=$((passed + 1))
  else
    echo "==== $name FAILED"
    failed=$((failed + 1))
  fi
}

ctest_build() {  # ctest_build DIR CMAKE_ARGS...
  local dir=$1
  shift
  # CTest's discovery reads test names as a CMake list, in which [ and ] group: one in a name
  # merges every test after it into one that runs none of them.
  if grep -rnE 'TEST_CASE\("[^"]*[][]' tests/cpp tests/cpp_torch; then
    echo "test names must not contain [ or ]: CTest would merge the tests after them into one"
    return 1
  fi
  cmake -S . -B "$dir" -G Ninja -DGPUMEM_BENCHMARKS=OFF "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
  ninja -C "$dir" -j "$JOBS" >"$dir.build.log" 2>&1 || { tail -n 60 "$dir.build.log"; return 1; }
  ctest --test-dir "$dir" --output-on-failure --no-tests=error -j "$JOBS"
}

pytest_run() {
  "$PYTHON" -m pip install -q --no-build-isolation . 2>&1 | grep -v "as the 'root' user"
  [ "${PIPESTATUS[0]}" = 0 ] || return 1
  # Run from tests/ so that `import gpumem` finds the installed package, not the source tree.
  (cd tests/python && "$PYTHON" -m pytest -q -rs .) 2>&1 | tee build/pytest.log
  local rc=${PIPESTATUS[0]}
  [ $rc = 5 ] && echo "pytest collected no test"
  return $rc
}

mkdir -p build
suite "core and adapter tests (CTest)" ctest_build build/release -DCMAKE_BUILD_TYPE=RelWithDebInfo
# Sanitized builds run the randomized tests at a tenth of their length.
export GPUMEM_PROPERTY_OPS=100000 GPUMEM_THREAD_OPS=20000
suite "ASan+UBSan (CTest)" ctest_build build/asan -DCMAKE_BUILD_TYPE=Debug \
  "-DGPUMEM_SANITIZE=address;undefined" -DGPUMEM_CHECK_INVARIANTS=ON -DGPUMEM_TORCH_TESTS=OFF
export TSAN_OPTIONS=halt_on_error=1 GPUMEM_THREAD_OPS=200000  # the threaded tests at full length
suite "TSan, threaded tests (CTest)" ctest_build build/tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGPUMEM_SANITIZE=thread -DGPUMEM_TORCH_TESTS=OFF "-DGPUMEM_TEST_SPEC=[threads]"
unset GPUMEM_PROPERTY_OPS GPUMEM_THREAD_OPS TSAN_OPTIONS
suite "Python tests (pytest)" pytest_run
suite "wheel (build, install in a fresh environment, use)" env PYTHON="$PYTHON" MAX_JOBS="$JOBS" bash tools/wheel_check.sh
main_failed=$failed
main_line="torch $("$PYTHON" -c "import torch; print(torch.__version__, '(CUDA', str(torch.version.cuda) + ')')"):"
main_line+=" core, sanitizers and adapter (CTest) and wheel $([ "$main_failed" = 0 ] && echo ok || echo 'see above');"
main_line+=" pytest $(grep -E "^=* ?[0-9]+ (passed|failed)" build/pytest.log 2>/dev/null | tail -n 1 | tr -d '=' | sed 's/ in [0-9.]*s.*//; s/^ *//')"

releases=()
for which in ${TORCH_RELEASES-oldest newest}; do
  rm -f "build/torch-$(sed -n "s/^TORCH_${which^^}=//p" tools/torch-versions)/result.txt"
  suite "torch $which (tools/torch-versions): adapter tests, wheel, Python tests" bash tools/torch_version_check.sh "$which"
  releases+=("$which")
done

echo
echo "torch releases run:"
echo "  $main_line"
for which in "${releases[@]}"; do
  result=build/torch-$(sed -n "s/^TORCH_${which^^}=//p" tools/torch-versions)/result.txt
  if [ -f "$result" ]; then echo "  $(cat "$result")"; else echo "  torch $which: did not finish (see above)"; fi
done
echo "suites: $passed passed, $failed failed"
[ "$failed" = 0 ]
