#!/usr/bin/env bash
# Instructions per malloc+free pair on bench_core's one-thread ring (the cached path), counted by
# callgrind: deterministic, so it serves where the machines are too noisy for nanoseconds. The
# count is of Ring::run, inclusive: the allocator's malloc and free plus the ring's few
# instructions of bookkeeping per pair; then the same for the ring by address (raw_alloc,
# raw_free). Builds a Release bench_core without the invariant checker in build/bench. Where
# python3 imports torch, it also counts the torch adapter's two rings (bench_adapter: raw_alloc_with_stream
# and raw_delete, what part 1 of docs/benchmarks.md calls; allocate() and the DataPtr's deleter, what
# a tensor calls), built in build/bench-adapter at -O3, as the extension is, against the installed torch.
# Usage: tools/count_instructions.sh [pairs per run, default 20000]
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-20000}
cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_TESTS=OFF -DGPUMEM_CHECK_INVARIANTS=OFF >/dev/null
ninja -C build/bench bench_core >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Ring::run is called once for the warm-up and once per measured run (the program prints how
# many), each with `pairs` pairs. `count PROGRAM RING LABEL [ARG]` counts one ring's runs, PROGRAM
# given `pairs` and ARG.
count() {
  local program=$1 ring=$2 label=$3 arg=${4:-}
  valgrind --tool=callgrind --collect-atstart=no "--toggle-collect=*Ring<*$ring>::run*" \
    --callgrind-out-file="$out/cg" "$program" "$pairs" $arg >"$out/log" 2>&1
  local total runs calls name
  name=$(basename "$program")
  total=$(callgrind_annotate "$out/cg" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
  runs=$(sed -n 's/.*median of \([0-9][0-9]*\) runs.*/\1/p' "$out/log")
  [ -n "$runs" ] || { echo "count_instructions.sh: $name did not say how many runs it made" >&2; exit 1; }
  calls=$((runs + 1))
  echo "$name $label: $total instructions in $((calls * pairs)) malloc+free pairs:" \
    "$(awk -v t="$total" -v n="$((calls * pairs))" 'BEGIN { printf "%.0f", t / n }') per pair"
}
count build/bench/bench_core ByBlock "one-thread ring" one-thread
count build/bench/bench_core ByAddress "one-thread ring by address (raw_alloc, raw_free)" one-thread

python3 -c "import torch" 2>/dev/null || { echo "count_instructions.sh: python3 has no torch: the adapter's rings not counted"; exit 0; }
# The adapter library is defined with the torch tests; only bench_adapter and what it links are built,
# at -O3 (Release) as setup.py builds the extension and build_bench_allocators.sh part 1's benchmark.
cmake -S . -B build/bench-adapter -G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O3 -DNDEBUG" \
  -DGPUMEM_TESTS=ON -DGPUMEM_TORCH_TESTS=ON -DGPUMEM_CHECK_INVARIANTS=OFF >/dev/null
ninja -C build/bench-adapter bench_adapter >/dev/null
# bench_adapter's ARG runs that ring alone.
count build/bench-adapter/bench_adapter Raw "raw ring (raw_alloc_with_stream, raw_delete)" raw
count build/bench-adapter/bench_adapter ByDataPtr "DataPtr ring (allocate, the DataPtr's deleter)" data_ptr
