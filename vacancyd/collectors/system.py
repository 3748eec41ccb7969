"""System capacity through psutil: memory and CPU."""

from __future__ import annotations

import psutil

from vacancyd.core.observations import CapacityReading

MIB = 1024 * 1024


def sample_memory() -> CapacityReading:
    """Available and total system memory in MiB; utilization is the used ratio (0–1)."""
    vm = psutil.virtual_memory()
    return CapacityReading(
        free_mib=vm.available / MIB, total_mib=vm.total / MIB, utilization=vm.percent / 100.0
    )


class CpuProbe:
    """Whole-machine CPU utilization (0–1) since the previous call; no byte capacity."""

    def __init__(self) -> None:
        psutil.cpu_percent(interval=None)  # prime: the first call has no interval to measure

    def __call__(self) -> CapacityReading:
        return CapacityReading(
            free_mib=None, total_mib=None, utilization=psutil.cpu_percent(interval=None) / 100.0
        )
