"""Refuses to load gpumem._C under a torch other than the one it was built against.

_C calls torch's C++ functions by their mangled names and relies on the layout of its classes,
neither of which PyTorch keeps from one release to the next (patch releases included), and it
links the CUDA runtime of torch's CUDA build (libcudart.so.13 for CUDA 13). Under another torch
it fails to load with an undefined symbol at best, and at worst loads and corrupts memory later.
So before loading _C, gpumem/__init__.py compares the torch at hand with the record that setup.py
wrote beside _C (gpumem/_build.py):

    torch's release     torch.__version__ up to any "+" (2.11.0, 2.11.0rc1, 2.12.0.dev20260105)
    its CUDA build      torch.version.cuda ("13.0"; None for a CPU-only torch)

Both must be the same, exactly. The label after "+" ("cu130") is not compared: for PyPI's and
PyTorch's wheels torch.version.cuda says the same, and builds from source or from distributions
label differently or not at all.

Without a record (a source tree whose _C was built by CMake or copied in, as developers work)
nothing is checked: a mismatch then shows as _C's own import error.
"""
from __future__ import annotations

import importlib
from typing import Optional

REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps ."


def require_matching_torch() -> None:
    """Raises ImportError naming both torches if _C was built against another one."""
    record = _build_record()
    if record is None:
        return
    import torch

    problem = mismatch(record, str(torch.__version__), torch.version.cuda)
    if problem is not None:
        raise ImportError(problem)


def mismatch(record, torch_version: str, torch_cuda: Optional[str]) -> Optional[str]:
    """Why a _C built as `record` (VERSION, TORCH_VERSION, TORCH_CUDA) must not load under this
    torch, or None if it may."""
    if (_release(record.TORCH_VERSION), record.TORCH_CUDA) == (_release(torch_version), torch_cuda):
        return None
    return (
        f"gpumem {record.VERSION} was built against torch {_describe(record.TORCH_VERSION, record.TORCH_CUDA)}, "
        f"but this is torch {_describe(torch_version, torch_cuda)}; its compiled module would not load "
        "(or worse). Rebuild gpumem against this torch, from gpumem's source tree: "
        f"`{REBUILD}`, or install the gpumem wheel built for this torch."
    )


def _build_record():
    try:
        return importlib.import_module("gpumem._build")
    except ModuleNotFoundError as error:
        if error.name != "gpumem._build":
            raise
        return None


def _release(torch_version: str) -> str:
    return torch_version.split("+")[0]


def _describe(torch_version: str, torch_cuda: Optional[str]) -> str:
    return f"{torch_version} ({'CUDA ' + torch_cuda if torch_cuda else 'CPU only'})"
