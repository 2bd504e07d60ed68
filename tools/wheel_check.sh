#!/usr/bin/env bash
# Builds gpumem's wheel against the torch installed here, then installs it in a fresh virtual
# environment that has no compiler and no CUDA headers, and uses it there: what a runtime-only
# image built from docs/deploy.md's Dockerfile does with it.
#
#   bash tools/wheel_check.sh                  # from the repository root or anywhere
#   bash tools/wheel_check.sh --keep DIR       # ... and keep the wheel in DIR
#   bash tools/wheel_check.sh --wheel FILE     # check a wheel built before, without building
#
# The build runs on a copy of the tree (tracked files and untracked ones git does not ignore), so
# nothing left by earlier builds gets in and the tree is left as it was. The environment sees the
# system's site-packages (torch is several GB; copying it proves nothing) but runs with nothing
# else: PATH is the environment's bin alone, CC and CXX are /bin/false, CUDA_HOME points nowhere,
# no PYTHONPATH or LD_LIBRARY_PATH. Exits non-zero if any step fails, with a line naming it.
set -uo pipefail
KEEP=""
wheel=""
case "${1:-}" in  # paths as given, from where the script was started
  --keep) KEEP=$(realpath -m "${2:?--keep needs a directory}") ;;
  --wheel) wheel=$(realpath -e "${2:?--wheel needs a file}") || exit 2 ;;
  "") ;;
  *) echo "usage: bash tools/wheel_check.sh [--keep DIR | --wheel FILE]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
DATA=$ROOT/tests/python/data

work=$(mktemp -d "${TMPDIR:-/tmp}/gpumem-wheel.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM HUP
failed=0

say() { echo "wheel_check: $*"; }
fatal() {
  echo "wheel_check: FAILED: $*" >&2
  exit 1
}

bare() {  # bare COMMAND...: runs COMMAND in the fresh environment, with nothing else on its paths
  env -i HOME="$work/home" LANG=C.UTF-8 PATH="$work/venv/bin" CC=/bin/false CXX=/bin/false \
    CUDA_HOME=/nonexistent "$@"
}

check() {  # check WHAT STATUS COMMAND...: COMMAND must exit with STATUS; its output is shown
  local what=$1 want=$2 status
  shift 2
  "$@" >"$work/out" 2>&1
  status=$?
  sed -n 's/^/    /; 1,25p' "$work/out"
  if [ "$status" = "$want" ]; then
    say "ok: $what"
  else
    echo "wheel_check: FAILED: $what (exit status $status, expected $want)" >&2
    failed=$((failed + 1))
  fi
}

copy_tree() {  # the files git would ship, plus untracked ones it does not ignore
  mkdir -p "$work/src"
  git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' path; do [ -e "$path" ] && printf '%s\0' "$path"; done |
    tar -cf - --null -T - | tar -xf - -C "$work/src"
}

build_wheel() {
  copy_tree || fatal "copying the tree (needs a git checkout)"
  say "building the wheel with $("$PYTHON" -c 'import torch; print("torch", torch.__version__)') (minutes)"
  "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w "$work/dist" "$work/src" >"$work/build.log" 2>&1 ||
    { tail -n 60 "$work/build.log"; fatal "building the wheel (pip wheel --no-build-isolation)"; }
  wheels=("$work"/dist/gpumem-*.whl)
  [ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || fatal "pip wheel made no single gpumem wheel: ${wheels[*]}"
  wheel=${wheels[0]}
  say "built $(basename "$wheel")"
  if [ -n "$KEEP" ]; then
    mkdir -p "$KEEP" && cp "$wheel" "$KEEP/" || fatal "copying the wheel to $KEEP"
  fi
}

install_in_fresh_environment() {
  # No pip of its own: the system's pip, run by the environment's python, installs into it.
  "$PYTHON" -m venv --system-site-packages --without-pip "$work/venv" || fatal "creating the virtual environment"
  # A venv made from inside another one sees the base interpreter's site-packages, not those of
  # the one $PYTHON runs in (tools/torch_version_check.sh's, with another torch): a .pth puts
  # $PYTHON's own in front of them.
  "$PYTHON" -c "import sys, sysconfig; sys.exit(sys.prefix == sys.base_prefix)" &&
    { "$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" >"$("$work/venv/bin/python" -c \
        "import sysconfig; print(sysconfig.get_paths()['purelib'])")/python-site-packages.pth" ||
      fatal "pointing the fresh environment at $PYTHON's site-packages"; }
  mkdir -p "$work/home"
  bare python -c "import shutil, sys; found = [c for c in ('cc', 'gcc', 'c++', 'g++', 'nvcc') if shutil.which(c)]; sys.exit(f'compilers on PATH: {found}' if found else 0)" ||
    fatal "the fresh environment is not bare"
  # --ignore-installed: a gpumem in the system's site-packages is left alone, and shadowed.
  bare python -m pip install -q --no-deps --no-index --ignore-installed --no-cache-dir "$wheel" ||
    fatal "installing the wheel in the fresh environment"
}

[ -n "$wheel" ] || build_wheel
check "the wheel holds every module of the package and its subpackages, the compiled module, its build record and the autoload hook" 0 \
  "$PYTHON" -c "
import pathlib, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
modules = sorted(path.relative_to('python').as_posix() for path in pathlib.Path('python/gpumem').rglob('*.py'))
wanted = modules + ['gpumem/_build.py', '_gpumem_autoload.py', '_gpumem_command.py', 'gpumem-autoload.pth']
missing = [n for n in wanted if n not in names] + ([] if any(n.startswith('gpumem/_C.') for n in names) else ['gpumem/_C.*.so'])
print('missing:', missing) if missing else print(len(names), 'files')
sys.exit(bool(missing))" "$wheel"
install_in_fresh_environment

check "import gpumem (from the fresh environment, not the system's)" 0 bare python -c "
import sys, gpumem
print(gpumem.__file__)
sys.exit(not gpumem.__file__.startswith(sys.prefix + '/'))"
check "the version carries the torch it was built against (+torch...), as the build record says" 0 bare python -c "
import sys, importlib.metadata, torch
from gpumem import _build
version = importlib.metadata.version('gpumem')
print('gpumem', version, 'for torch', _build.TORCH_VERSION, '/ CUDA', _build.TORCH_CUDA, '; torch here:', torch.__version__)
sys.exit(not ('+torch' in version and version == _build.VERSION and _build.TORCH_VERSION == str(torch.__version__)))"
check "importing under another torch is an ImportError naming both, not an undefined symbol" 0 bare python -c "
import subprocess, sys
completed = subprocess.run([sys.executable, '-c', 'import torch; torch.__version__ = \"2.9.0\"; import gpumem'], capture_output=True, text=True)
print(completed.stderr.strip().splitlines()[-1])
sys.exit(not (completed.returncode != 0 and 'built against torch' in completed.stderr and 'undefined symbol' not in completed.stderr))"
check "gpumem --help" 0 bare gpumem --help
check "gpumem info" 0 bare gpumem info
if [ "$(bare python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)" = 0 ]; then
  grep -q "no CUDA device" "$work/out" && say "ok: gpumem info says there is no device" ||
    { echo "wheel_check: FAILED: gpumem info, without a device, does not say so" >&2; failed=$((failed + 1)); }
fi
check "GPUMEM_LIMIT installs gpumem when torch is imported (the .pth hook)" 0 bare GPUMEM_LIMIT=1GB python -c "
import sys, torch
from gpumem import _autoload
print('autoload:', _autoload.state)
sys.exit(_autoload.state != 'installed')"
check "gpumem replay resnet_sgd.pickle --limit 1GB: fits (exit status 0)" 0 \
  bare gpumem replay "$DATA/resnet_sgd.pickle" --limit 1GB
check "gpumem replay gpt_adamw.pickle --limit 1GB: does not fit (exit status 1)" 1 \
  bare gpumem replay "$DATA/gpt_adamw.pickle" --limit 1GB

if [ "$failed" != 0 ]; then
  echo "wheel_check: FAILED: $failed check(s) of $(basename "$wheel") in a fresh environment" >&2
  exit 1
fi
say "passed: $(basename "$wheel") builds here and works in a fresh environment without a compiler"
