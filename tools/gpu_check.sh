#!/usr/bin/env bash
# What a GPU machine runs to check gpumem end to end: build, the Python tests (GPU ones included),
# the demo, and the capture of the replay snapshots. Logs go to $OUT (default ./gpu-logs).
# TESTS picks pytest files (default: all); CAPTURE=0 skips the capture.
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
(cd tests/python && python3 -m pytest -q -rs -p no:cacheprovider ${TESTS:-.}) 2>&1 | tee "$out/pytest.log"
tests=${PIPESTATUS[0]}
(cd tools && timeout 120 python3 demo.py) 2>&1 | tee "$out/demo.log"
if [ "${CAPTURE:-1}" = 1 ]; then
  timeout 180 python3 tools/capture_snapshots.py --out "$out/snapshots" 2>&1 | tee "$out/capture.log"
fi
exit "$tests"
