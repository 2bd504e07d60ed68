#!/usr/bin/env python3
"""Records what the figures were measured on: GPU, driver, torch, CUDA, CPUs, gpumem's source.

    python3 benchmarks/machine.py OUT.json
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

import gpumem._C
from common import write_json


def command(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main() -> None:
    smi = command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").splitlines()
    commit = command("git", "rev-parse", "--short", "HEAD")
    if commit and command("git", "status", "--porcelain"):
        commit += " + uncommitted changes"
    cuda = torch.cuda.is_available()
    write_json(sys.argv[1], {
        "gpu": torch.cuda.get_device_name(0) if cuda else "no CUDA device",
        "gpu_memory": torch.cuda.get_device_properties(0).total_memory if cuda else 0,
        "driver": smi[0].strip() if smi else "unknown",
        "torch": torch.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count(),
        "gpumem_commit": commit or "unknown (no git repository)", "gpumem_module": gpumem._C.__file__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    })


if __name__ == "__main__":
    main()
