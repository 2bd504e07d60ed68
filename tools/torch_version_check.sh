#!/usr/bin/env bash
# gpumem run under another torch release than the one installed, on the simulated device:
#
#   bash tools/torch_version_check.sh 2.6.0        # or oldest / newest (tools/torch-versions)
#
# In a virtual environment of that release's own (created once per machine under
# $GPUMEM_TORCH_VENVS, default ~/.cache/gpumem/torch-venvs, and reused while its torch is the one
# asked for, so each release is downloaded once), it runs:
#   1. the torch adapter's C++ tests (tests/cpp_torch), built by CMake against that torch;
#   2. the wheel check (tools/wheel_check.sh): a wheel built against that torch, installed and used
#      in a fresh environment without a compiler;
#   3. the Python suite (pytest), against that same wheel installed in the release's environment.
# Ends with one line, also written to build/torch-<version>/result.txt:
#   torch 2.6.0+cu124 (CUDA 12.4): adapter 126 passed; pytest 1245 passed, 89 skipped; wheel ok (15 min)
# Exit status: 0 all three passed; 1 one failed (its output is above); 2 the environment could not
# be made (no network and no environment kept from before, for example).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
version=${1:?"usage: bash tools/torch_version_check.sh VERSION | oldest | newest"}
case "$version" in
  oldest) version=$(sed -n 's/^TORCH_OLDEST=//p' tools/torch-versions) ;;
  newest) version=$(sed -n 's/^TORCH_NEWEST=//p' tools/torch-versions) ;;
esac
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
  { echo "torch_version_check: '$version' is not a release (accepted: X.Y.Z, oldest, newest)" >&2; exit 2; }
JOBS=${JOBS:-$(nproc)}
venv=${GPUMEM_TORCH_VENVS:-$HOME/.cache/gpumem/torch-venvs}/torch-$version
build=$ROOT/build/torch-$version
mkdir -p "$build"
say() { echo "torch_version_check ($version): $*"; }

has_torch() {
  "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null
}
if ! has_torch; then
  say "making $venv (torch==$version and the test tools: several GB, once per machine)"
  rm -rf "$venv"
  python3 -m venv "$venv" && "$venv/bin/python" -m pip install -q "torch==$version" ||
    { say "FAILED: the environment could not be made"; exit 2; }
fi
"$venv/bin/python" -m pip install -q -r tools/requirements-test.txt 2>&1 | grep -v "as the 'root' user"
[ "${PIPESTATUS[0]}" = 0 ] || { say "FAILED: the test tools did not install"; exit 2; }
PYTHON=$venv/bin/python
export PATH=$venv/bin:$PATH  # CMake's probe runs `python3`: this release's
torch_label=$("$PYTHON" -c "import torch; print(torch.__version__, '(CUDA', str(torch.version.cuda) + ')')")
say "$torch_label in $venv"

failed=0
# 1. The adapter's tests. The core and the tests proper are not built: the main build ran them.
adapter="not run"
if cmake -S . -B "$build/cmake" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGPUMEM_BENCHMARKS=OFF \
    -DGPUMEM_TORCH_TESTS=ON >"$build/configure.log" 2>&1 &&
  ninja -C "$build/cmake" -j "$JOBS" gpumem_torch_tests >"$build/build.log" 2>&1; then
  ctest --test-dir "$build/cmake" -R "^torch:" --no-tests=error -j "$JOBS" --output-on-failure >"$build/ctest.log" 2>&1
  status=$?
  tail -n 3 "$build/ctest.log"
  total=$(sed -n 's/.* tests passed, [0-9]* tests failed out of \([0-9]*\)/\1/p' "$build/ctest.log")
  if [ "$status" = 0 ]; then adapter="$total passed"; else adapter="FAILED"; failed=1; grep -B2 -A30 "Failed" "$build/ctest.log" | head -n 80; fi
else
  adapter="FAILED (build)"
  failed=1
  tail -n 40 "$build/configure.log" "$build/build.log"
fi
say "adapter tests: $adapter"

# 2. The wheel, built once: checked in a fresh environment, then installed for the Python suite.
rm -rf "$build/wheel"
wheel="FAILED"
if PYTHON=$PYTHON MAX_JOBS=$JOBS bash tools/wheel_check.sh --keep "$build/wheel"; then
  wheel="ok"
else
  failed=1
fi

# 3. The Python suite against that wheel (or, where it was not built, against `pip install .`).
pytest_line="not run"
built=("$build"/wheel/gpumem-*.whl)
if [ -f "${built[0]}" ]; then
  install=("$PYTHON" -m pip install -q --no-deps --force-reinstall "${built[0]}")
else
  install=("$PYTHON" -m pip install -q --no-build-isolation --force-reinstall --no-deps .)
fi
if "${install[@]}" >"$build/install.log" 2>&1; then
  (cd tests/python && "$PYTHON" -m pytest -q -rs -p no:cacheprovider .) 2>&1 | tee "$build/pytest.log"
  status=${PIPESTATUS[0]}
  pytest_line=$(grep -E "^=* ?[0-9]+ (passed|failed)" "$build/pytest.log" | tail -n 1 | tr -d '=' | sed 's/ in [0-9.]*s.*//; s/^ *//; s/ *$//')
  [ "$status" = 0 ] || { failed=1; pytest_line="FAILED: $pytest_line"; }
  [ "$status" = 5 ] && pytest_line="FAILED: no test collected"
else
  failed=1
  pytest_line="FAILED (install)"
  tail -n 30 "$build/install.log"
fi

line="torch $torch_label: adapter $adapter; pytest $pytest_line; wheel $wheel ($((SECONDS / 60)) min)"
echo "$line" | tee "$build/result.txt"
exit "$failed"
