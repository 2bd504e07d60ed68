#!/usr/bin/env bash
# Runs benchmarks 1-5, 8 and 9 of docs/benchmarks.md on a machine with a CUDA GPU, each part in its
# own process(es), within BENCH_BUDGET_S seconds (default 560, including the gpumem install when one
# is needed: the whole fits one 10-minute call). Each part writes JSON and a log into OUTDIR; at the
# end the results section (summarize.py: the command, from OUTDIR/command.txt, the machine, the table)
# is printed and written to OUTDIR/summary.md.
#   bash benchmarks/run_all.sh [OUTDIR]          (default: bench-out)
# gpumem is installed first (pip install --no-build-isolation -e .): when the gpumem python3
# imports is not this tree's, this script installs it that way, on its budget.
set -uo pipefail
# The command as given, with the settings below that came from the environment: command.txt, for
# summarize.py's section (read before the defaults fill them in).
COMMAND=""
for v in PYTHON BENCH_BUILD_DIR BENCH_BUDGET_S BENCH_ALLOC_ROUNDS BENCH_ALLOC_THREADS_ROUNDS BENCH_EMPTY_ROUNDS \
  BENCH_THREADS_ROUNDS BENCH_TRAIN_ROUNDS; do
  [[ -n ${!v+set} ]] && COMMAND+=$(printf '%s=%q ' "$v" "${!v}")
done
COMMAND+="bash benchmarks/run_all.sh$( (($#)) && printf ' %q' "$@")"
PYTHON=${PYTHON:-python3}  # every step runs this interpreter, the install too: a bare `pip` may be another
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-bench-out}
BIN=${BENCH_BUILD_DIR:-/tmp/gpumem-bench-build}  # objects and binary: kept out of OUTDIR
BUDGET=${BENCH_BUDGET_S:-560}
ALLOC_ROUNDS=${BENCH_ALLOC_ROUNDS:-3}  # part 1: processes (each times every allocator, alternating)
ALLOC_THREADS_ROUNDS=${BENCH_ALLOC_THREADS_ROUNDS:-3}  # part 8: processes (each times both, alternating)
EMPTY_ROUNDS=${BENCH_EMPTY_ROUNDS:-3}  # part 2: processes per allocator, alternating
THREADS_ROUNDS=${BENCH_THREADS_ROUNDS:-3}  # part 9: processes per allocator, alternating
TRAIN_ROUNDS=${BENCH_TRAIN_ROUNDS:-3}  # part 3: processes per allocator, alternating
mkdir -p "$OUT"
# A previous run's results would mix into the medians: remove them (only files this script writes).
# A measurement repeated in processes is NAME-ROUND.{json,log}; summarize.py reads each NAME's
# rounds by their exact name (training-step-gpumem-1.json, never training-step-gpumem-plain-1.json).
rm -f "$OUT"/{replay,machine}.json "$OUT"/command.txt "$OUT"/{install,machine,build,replay}.log "$OUT"/allocators-*.{json,log} \
  "$OUT"/allocator-threads-*.{json,log} "$OUT"/torch_empty-*.{json,log} "$OUT"/threads-*.{json,log} \
  "$OUT"/training-*.{json,log} "$OUT"/summary.md
echo "$COMMAND" >"$OUT/command.txt"
unset GPUMEM_LIMIT PYTORCH_CUDA_ALLOC_CONF  # each process picks its allocator itself
SECONDS=0

log() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }

# run NAME LIMIT_S COMMAND...: output in $OUT/NAME.log; the limit never passes the budget left.
run() {
  local name=$1 limit=$2 left=$((BUDGET - SECONDS))
  shift 2
  if ((left < 20)); then
    log "SKIP  $name: the time budget is spent"
    return 1
  fi
  ((limit > left)) && limit=$left
  log "start $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local status=$?
  if ((status == 0)); then
    log "done  $name"
    return 0
  fi
  log "FAIL  $name: exit $status$( ((status == 124)) && echo " (over its ${limit} s)"); the end of $OUT/$name.log:"
  tail -n 15 "$OUT/$name.log" | sed 's/^/    /'
  return 1
}

# gpumem from this tree, built against the installed torch (an install of another tree would measure that)
from_this_tree() {
  "$PYTHON" -c "import os, sys, gpumem._C as c; r = os.path.realpath
sys.exit(not r(c.__file__).startswith(r('python') + os.sep))" 2>/dev/null
}
if ! from_this_tree; then
  run install 240 "$PYTHON" -m pip install --no-build-isolation --no-index -e . || exit 1
  from_this_tree || { log "python3 still imports a gpumem from elsewhere: $("$PYTHON" -c 'import gpumem; print(gpumem.__file__)')"; exit 1; }
fi
run machine 60 "$PYTHON" benchmarks/machine.py "$OUT/machine.json"

# The build and the replay (part 5) use only the CPU: run them together, before anything is timed.
log "start build of bench_allocators and part 5 (replay, CPU only), in parallel"
run replay 120 "$PYTHON" benchmarks/bench_replay.py --out "$OUT/replay.json" &
REPLAY=$!
run build 180 bash benchmarks/build_bench_allocators.sh "$BIN/bench_allocators" "$BIN/obj"
BUILT=$?
wait "$REPLAY"
if ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  log "no CUDA GPU here: parts 1-4, 8 and 9 not run"
  "$PYTHON" benchmarks/summarize.py "$OUT" | tee "$OUT/summary.md"
  exit 1
fi

if ((BUILT == 0)); then
  for ((r = 1; r <= ALLOC_ROUNDS; r++)); do
    run "allocators-$r" 90 "$BIN/bench_allocators" --pairs 200000 --runs 7 --cuda-pairs 2000 --out "$OUT/allocators-$r.json"
  done
  # Part 8: the same interface from 1 to 16 threads, on their own streams and on 2 shared ones.
  for ((r = 1; r <= ALLOC_THREADS_ROUNDS; r++)); do
    run "allocator-threads-$r" 60 "$BIN/bench_allocators" --threads 1,2,4,8,16 --streams own,shared \
      --shared-streams 2 --pairs 4000 --runs 5 --out "$OUT/allocator-threads-$r.json"
  done
fi

# native-zero: 0-byte tensors, torch's share of a pair with no allocator work (the floor under part 2).
for ((r = 1; r <= EMPTY_ROUNDS; r++)); do
  for a in gpumem native native-zero; do
    run "torch_empty-$a-$r" 60 "$PYTHON" benchmarks/bench_torch_empty.py --allocator "${a%-zero}" \
      $([[ $a == *-zero ]] && echo --zero) --out "$OUT/torch_empty-$a-$r.json"
  done
done

# Part 9: 8 Python threads on their own streams under a 6 GiB cap; native-noalloc: the same operations
# on views of one buffer per thread, no allocator work (the ceiling over part 9's ratio).
for ((r = 1; r <= THREADS_ROUNDS; r++)); do
  for a in gpumem native native-noalloc; do
    run "threads-$a-$r" 45 "$PYTHON" benchmarks/bench_threads.py --allocator "${a%-noalloc}" \
      $([[ $a == *-noalloc ]] && echo --no-alloc) --threads 8 --cap 6GiB \
      --warm-up 1 --duration 1 --runs 3 --out "$OUT/threads-$a-$r.json"
  done
done

# Round 1 also measures gpumem with plain segments; later rounds only what the targets compare.
train_round() {
  local allocators="gpumem native native-expandable"
  (($1 == 1)) && allocators="gpumem gpumem-plain native native-expandable"
  for a in $allocators; do
    run "training-step-$a-$1" 120 "$PYTHON" benchmarks/bench_training.py --mode step --allocator "$a" \
      --out "$OUT/training-step-$a-$1.json"
  done
}
train_round 1
# Part 4 before the further rounds of part 3: if time runs short, a repeat is what goes.
run training-reference 120 "$PYTHON" benchmarks/bench_training.py --mode reference --allocator native \
  --out "$OUT/training-reference.json"
for a in gpumem gpumem-plain native native-expandable; do
  run "training-cap-$a" 120 "$PYTHON" benchmarks/bench_training.py --mode cap --allocator "$a" --out "$OUT/training-cap-$a.json"
done
for ((r = 2; r <= TRAIN_ROUNDS; r++)); do train_round "$r"; done

log "all parts run in ${SECONDS} s; the results (also in $OUT/summary.md):"
"$PYTHON" benchmarks/summarize.py "$OUT" | tee "$OUT/summary.md"
