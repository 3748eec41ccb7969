"""GPU capacity through NVML (nvidia-ml-py's ``pynvml``), product map C1.

Free and total memory (MiB) and utilization (0–1) of one GPU selected by NVML index. When
the NVML library cannot be loaded or a call fails, the probe raises :class:`ProbeError` and
the resource stays unmeasured: vacancyd never makes up a number. NVML is initialised on first
use and again after a failure, so a driver that appears later is picked up.
"""

from __future__ import annotations

import threading

import pynvml

from vacancyd.collectors.base import ProbeError
from vacancyd.core.observations import CapacityReading

MIB = 1024 * 1024
_init_lock = threading.Lock()


class NvmlProbe:
    """Samples one GPU. Call only from one thread (the collector's executor)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._handle: object | None = None

    def _ensure(self) -> object:
        if self._handle is None:
            with _init_lock:
                try:
                    pynvml.nvmlInit()
                    self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
                except pynvml.NVMLError as exc:
                    raise ProbeError(f"NVML unavailable for GPU {self.index}: {exc}") from exc
        return self._handle

    def __call__(self) -> CapacityReading:
        handle = self._ensure()
        try:
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                utilization: float | None = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except pynvml.NVMLError_NotSupported:
                utilization = None
        except pynvml.NVMLError as exc:
            self._handle = None  # re-resolve next time (GPU lost, driver reloaded)
            raise ProbeError(f"NVML query of GPU {self.index} failed: {exc}") from exc
        free, total = int(memory.free), int(memory.total)
        if total <= 0 or free < 0 or free > total:
            raise ProbeError(
                f"NVML reported implausible memory for GPU {self.index}: {free}/{total}"
            )
        return CapacityReading(free_mib=free / MIB, total_mib=total / MIB, utilization=utilization)
