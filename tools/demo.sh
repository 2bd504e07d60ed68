#!/usr/bin/env bash
# gpumem's main job on a fresh machine: installs what is missing, builds and installs gpumem, and
# runs tools/demo.py: training under a 2 GiB cap on a GPU, or, without one, a replay of a shipped
# snapshot of a real training run under a 3 GB cap on the simulated device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip install -q --no-build-isolation . 2>&1 | { grep -v "as the 'root' user" || true; }
cd tools && exec "$PYTHON" demo.py
