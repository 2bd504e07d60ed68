"""The run directory: where each process publishes its figures for `gpumem top` and where GPUs'
sharing tables live (GPUMEM_RUN_DIR, else /tmp/gpumem-<uid>). Whether one is trusted is
gpumem.monitoring.published's rule (run_dir_problem)."""
from __future__ import annotations

import os
from dataclasses import dataclass

RUN_DIR_BASE = "/tmp"


@dataclass(frozen=True)
class RunDir:
    """Where the files go: `path`, and whether GPUMEM_RUN_DIR chose it (else it is the default,
    which must be the user's own)."""
    path: str
    chosen: bool = False


def default_run_dir() -> RunDir:
    return RunDir(os.path.join(RUN_DIR_BASE, f"gpumem-{os.geteuid()}"))
