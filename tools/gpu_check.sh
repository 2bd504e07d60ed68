#!/usr/bin/env bash
# What a GPU machine runs to check gpumem end to end: build, the Python tests (GPU ones included),
# the demo, and the capture of the replay snapshots. Logs go to $OUT (default ./gpu-logs).
# TESTS picks pytest files (default: all); CAPTURE=0 skips the capture. With pytest-xdist the tests
# run in JOBS processes (default 8; each GPU test starts its own interpreter).
# PART splits the whole into calls of a few minutes each (build included):
#   PART=1  the allocator under torch: install, GPUMEM_LIMIT, statistics, growable segments, what
#           the code around torch sees (then the CUDA backend's conformance suite and the demo)
#   PART=2  CUDA graphs, cudagraph trees, MemPool, training, and every test that needs no GPU
#           (then the snapshot capture)
# Exit status: 0 everything run passed; 1 something failed (the build, a pytest test, the conformance
# suite; their output is in $OUT); 3 incomplete: everything run passed but the
# conformance suite could not be built (no CMake, Ninja or Catch2 v2 header: tools/conformance.sh
# prints one line saying which), so it was not run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} | tee "$out/machine.txt"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
start=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . >"$out/build.log" 2>&1 ||
  { tail -n 60 "$out/build.log"; exit 1; }
echo "build: $(($(date +%s) - start)) s"
part1="test_gpu_install.py test_gpu_autoload.py test_gpu_memory_stats.py test_gpu_growable.py test_gpu_drop_in.py"
case "${PART:-}" in
  "") ;;
  1) TESTS=${TESTS:-$part1}; CAPTURE=${CAPTURE:-0}; CONFORMANCE=${CONFORMANCE:-1} ;;
  2) TESTS=${TESTS:-$(cd tests/python && ls test_*.py | grep -vxF -f <(tr ' ' '\n' <<<"$part1") | tr '\n' ' ')}
     DEMO=${DEMO:-0} ;;
  *) echo "gpu_check.sh: PART must be 1 or 2, not '$PART'" >&2; exit 2 ;;
esac
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n "${JOBS:-8}")
(cd tests/python && python3 -m pytest -q -rs -p no:cacheprovider "${parallel[@]}" ${TESTS:-.}) 2>&1 | tee "$out/pytest.log"
pytest_status=${PIPESTATUS[0]}
failed=0
[ "$pytest_status" = 0 ] || failed=1
# The backend conformance suite for the CUDA backend (tools/conformance.sh): with PART=1, or
# CONFORMANCE=1. Needs CMake, Ninja and Catch2 v2 (Debian's catch2, or CATCH2_INCLUDE: a directory
# holding catch2/catch.hpp); without them it is reported as not built, and the run as incomplete.
not_built=""
if [ "${CONFORMANCE:-0}" = 1 ]; then
  bash tools/conformance.sh 2>&1 | tee "$out/conformance.log"
  case "${PIPESTATUS[0]}" in
    0) ;;
    3) not_built=$(grep -m1 "NOT BUILT" "$out/conformance.log") ;;
    *) failed=1 ;;
  esac
fi
if [ "${DEMO:-1}" = 1 ]; then
  (cd tools && timeout 120 python3 demo.py) 2>&1 | tee "$out/demo.log"
fi
if [ "${CAPTURE:-1}" = 1 ]; then
  timeout 180 python3 tools/capture_snapshots.py --out "$out/snapshots" 2>&1 | tee "$out/capture.log"
fi
if ((failed)); then
  echo "gpu_check: FAILED (logs in $out)"
  exit 1
fi
if [ -n "$not_built" ]; then
  echo "gpu_check: INCOMPLETE (exit 3): everything run passed, but the $not_built"
  exit 3
fi
echo "gpu_check: passed"
