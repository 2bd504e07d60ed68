"""What the driver says about the machine's GPUs, through NVML (the nvidia-ml-py package, module
pynvml): for `gpumem top`. An optional dependency, imported only here and only when asked.

    with Nvml() as nvml:
        for gpu in nvml.gpus(): ...

gpus() is the whole interface `gpumem top` uses: a fake NVML for tests is any object with it (and
the context manager). A GPU that cannot be read is listed with its error and no processes, so one
faulty GPU does not hide the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

INSTALL = "pip install nvidia-ml-py (or pip install 'gpumem[top]')"


class NvmlError(Exception):
    """NVML cannot be used: the package is missing, or the driver cannot be reached."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # as the driver knows it: in the host's pid namespace
    used: Optional[int]  # bytes the driver counts for the process on this GPU; None where it cannot say


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML's: every GPU of the machine, CUDA_VISIBLE_DEVICES does not apply
    name: str
    uuid: str
    total: Optional[int]
    used: Optional[int]
    processes: tuple[GpuProcess, ...] = ()
    error: Optional[str] = None  # why this GPU could not be read


class Nvml:
    """NVML, initialized while the context is open."""

    def __init__(self):
        self._pynvml = _pynvml()

    def __enter__(self) -> "Nvml":
        try:
            self._pynvml.nvmlInit()
        except self._pynvml.NVMLError as error:
            raise NvmlError(f"NVML cannot be started ({error}): is the NVIDIA driver installed and loaded?") from None
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._pynvml.nvmlShutdown()
        except self._pynvml.NVMLError:
            pass  # nothing to do about it, and the figures are out

    def gpus(self) -> list[Gpu]:
        nvml = self._pynvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as error:
            raise NvmlError(f"NVML cannot count the GPUs ({error})") from None
        return [self._gpu(index) for index in range(count)]

    def _gpu(self, index: int) -> Gpu:
        nvml = self._pynvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name, uuid = _text(nvml.nvmlDeviceGetName(handle)), _text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError as error:
            return Gpu(index, "?", "?", None, None, error=str(error))
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            processes = tuple(GpuProcess(int(p.pid), _bytes(p.usedGpuMemory))
                              for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except nvml.NVMLError as error:
            return Gpu(index, name, uuid, None, None, error=str(error))
        return Gpu(index, name, uuid, _bytes(memory.total), _bytes(memory.used), processes)


def _pynvml():
    try:
        import pynvml
    except ImportError as error:
        raise NvmlError(f"gpumem top reads the GPUs through NVML, with the nvidia-ml-py package (module pynvml), "
                        f"which cannot be imported ({error}): {INSTALL}") from None
    return pynvml


def _text(value) -> str:
    # Older pynvml returns bytes.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _bytes(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
