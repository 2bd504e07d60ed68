#!/usr/bin/env bash
# Installs what building and testing gpumem needs, skipping whatever is already there.
# Debian 12 with the CUDA toolkit at /usr/local/cuda (or CUDA_HOME); runs as root or with sudo.
set -euo pipefail
cd "$(dirname "$0")/.."

# The torch CI builds against (tools/torch-versions; the device machine runs it too, as +cu130).
TORCH_VERSION=$(sed -n 's/^TORCH_MAIN=//p' tools/torch-versions)
[ -n "$TORCH_VERSION" ] || { echo "setup: tools/torch-versions names no TORCH_MAIN" >&2; exit 1; }
PYTHON=${PYTHON:-python3}
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

apt_packages=()
for pkg in catch2 cmake ninja-build g++; do
  dpkg -s "$pkg" >/dev/null 2>&1 || apt_packages+=("$pkg")
done
if [ ${#apt_packages[@]} -gt 0 ]; then
  echo "setup: installing ${apt_packages[*]} from Debian"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${apt_packages[@]}" >/dev/null
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION (a CUDA build of several GB; once per machine)"
  "$PYTHON" -m pip install -q "torch==$TORCH_VERSION"
fi

"$PYTHON" -m pip install -q -r tools/requirements-test.txt 2>&1 | grep -v "as the 'root' user" || true

cuda_home=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$cuda_home/include/cuda_runtime_api.h" ]; then
  echo "setup: no CUDA toolkit headers under $cuda_home (set CUDA_HOME); gpumem's extension needs them" >&2
  exit 1
fi
echo "setup: ready (torch $("$PYTHON" -c 'import torch; print(torch.__version__)'), CUDA headers in $cuda_home)"
