#!/usr/bin/env bash
# One call of PyTorch's test files on a GPU machine: installs what they need and gpumem (skipped
# where gpumem._C already imports), runs tools/torch_tests.py, and leaves the results in $OUT.
#
#   tools/torch_tests_device.sh collect
#   tools/torch_tests_device.sh run --file inductor/test_cudagraph_trees.py --shard 1/3
#
# TT (default build-torch-tests): PyTorch's test files as laid out in their tree (TT/test/...),
#   with TT/wheels holding expecttest and psutil, which the torch wheel does not bring.
# RESULTS (default build-torch-results): the results so far; carry it back in to go on where the
#   last call stopped. Both defaults match build*/ in .gitignore, so they travel only when carried.
# CALL_S (default 510): seconds from CALL_START (default: this script's start) by which the tests
#   stop, so that the call ends within 9 minutes with the build included; --budget overrides it.
# Leaves $OUT/summary.txt and $OUT/results.tgz (RESULTS, to unpack in the project's root).
# Exit status: tools/torch_tests.py's (0 done, 3 to run again, 2 could not start).
set -uo pipefail
cd "$(dirname "$0")/.."
start=${CALL_START:-$(date +%s)}
tt=${TT:-build-torch-tests}
results=${RESULTS:-build-torch-results}
out=${OUT:-torch-tests-out}
mkdir -p "$out" "$results"
command=${1:?"usage: $0 collect|run [options of tools/torch_tests.py]"}
shift
python3 -m pip install -q --no-index --find-links "$tt/wheels" expecttest psutil ||
  { echo "torch_tests_device.sh: expecttest and psutil did not install from $tt/wheels"; exit 2; }
if ! python3 -c "import gpumem._C" 2>/dev/null; then
  MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . \
    >"$out/build.log" 2>&1 || { tail -n 40 "$out/build.log"; exit 2; }
fi
echo "setup: $(($(date +%s) - start)) s"
budget=()
[ "$command" = run ] && budget=(--budget "$(( ${CALL_S:-510} - ($(date +%s) - start) ))")
python3 tools/torch_tests.py "$command" "$tt/test" "$results" "${budget[@]}" "$@"
status=$?
python3 tools/torch_tests.py summary "$results" >"$out/summary.txt"
cat "$out/summary.txt"
tar czf "$out/results.tgz" "$results"
echo "took: $(($(date +%s) - start)) s"
exit "$status"
