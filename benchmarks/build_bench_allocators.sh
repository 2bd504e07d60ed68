#!/usr/bin/env bash
# Builds benchmarks/bench_allocators.cpp against the installed torch, with gpumem's core, CUDA
# backend and torch adapter compiled in (not install.cpp: the benchmark never installs gpumem),
# the same GPUMEM_TORCH_HAS_* macros setup.py uses, and CUB from the CUDA toolkit.
#   bash benchmarks/build_bench_allocators.sh [OUTPUT_BINARY] [OBJECT_DIR]
# Needs g++, python3 with torch, and the toolkit's headers (CUDA_HOME, default /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-build-bench/bench_allocators}
OBJ=${2:-$(dirname "$BIN")/obj}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$OBJ" "$(dirname "$BIN")"

# torch's directory, ABI, C++ standard, feature macros and the cudart it loads, in one python3 call.
mapfile -t PROBE < <(python3 - <<'PY'
import importlib.util, os, torch
spec = importlib.util.spec_from_file_location("gpumem_setup", "setup.py")
setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup)
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
print(os.path.dirname(torch.__file__))
print(int(torch.compiled_with_cxx11_abi()))
print("c++20" if (major, minor) >= (2, 13) else "c++17")
print(" ".join("-D" + m for m in setup.torch_feature_macros()))
print("\n".join(setup.cudart_library()))
PY
)
TORCH=${PROBE[0]} ABI=${PROBE[1]} STD=${PROBE[2]} MACROS=${PROBE[3]} CUDART_DIR=${PROBE[4]} CUDART=${PROBE[5]}
# -O3 as setup.py builds the extension: part 1 measures the code that ships.
# shellcheck disable=SC2206
FLAGS=(-std=$STD -O3 -DNDEBUG -fPIC -D_GLIBCXX_USE_CXX11_ABI=$ABI $MACROS -Icsrc -isystem "$TORCH/include")
if [[ -f $CUDA_HOME/include/cccl/cub/util_allocator.cuh ]]; then
  FLAGS+=(-isystem "$CUDA_HOME/include/cccl")
elif [[ ! -f $CUDA_HOME/include/cub/util_allocator.cuh ]]; then  # before CUDA 12.8 CUB lay here
  echo "warning: no CUB under $CUDA_HOME/include: building without the CUB comparison" >&2
  FLAGS+=(-DGPUMEM_BENCH_NO_CUB=1)
fi
FLAGS+=(-isystem "$CUDA_HOME/include")

SOURCES=(csrc/core/*.cpp csrc/backends/*.cpp csrc/torch/*.cpp benchmarks/bench_allocators.cpp)
OBJECTS=() PIDS=()
for src in "${SOURCES[@]}"; do
  [[ $src == csrc/torch/install.cpp ]] && continue
  obj=$OBJ/${src//\//_}.o
  OBJECTS+=("$obj")
  rm -f "$obj"
  g++ "${FLAGS[@]}" -c "$src" -o "$obj" &
  PIDS+=($!)
  while (($(jobs -rp | wc -l) >= $(nproc))); do wait -n || true; done  # at most nproc at once
done
for pid in "${PIDS[@]}"; do wait "$pid"; done  # each compile's status: set -e stops at a failure
g++ "${OBJECTS[@]}" -o "$BIN" -L"$TORCH/lib" -lc10_cuda -lc10 -L"$CUDART_DIR" -l"$CUDART" -lpthread \
    -Wl,-rpath,"$TORCH/lib" -Wl,-rpath,"$CUDART_DIR"
echo "built $BIN"
