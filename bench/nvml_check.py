"""One short check of vacancyd's GPU collectors against a real NVIDIA driver.

For a machine with a GPU (this project's ``device`` tool, or any NVIDIA host):

    .venv/bin/python bench/nvml_check.py > nvml-check.txt

It prints, for every GPU NVML lists: what pynvml returns for the calls vacancyd makes
(memory, utilization, UUID, PCI bus id, running compute and graphics processes, process
utilization samples), what vacancyd's own probes make of them (capacity through NVML,
capacity through nvidia-smi, one pressure attribution), how long each took, and whether
NVML and nvidia-smi agree on total memory. It only reads; it allocates nothing on the GPU.
Record the output in docs/benchmarks.md ("Real-driver check"). Exit status 0 when every
probe produced a reading, 1 otherwise.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pynvml

from vacancyd.collectors.base import ProbeError
from vacancyd.collectors.nvidia import (
    GpuPressureProbe,
    NvmlGpu,
    SmiProbe,
    read_nvml_capacity,
)
from vacancyd.core.gpu import GpuSelector


def timed(label: str, fn):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    try:
        value = fn()
    except (ProbeError, pynvml.NVMLError) as exc:
        print(f"  {label}: ERROR {exc} ({(time.perf_counter() - started) * 1e3:.1f} ms)")
        return None
    print(f"  {label}: {value} ({(time.perf_counter() - started) * 1e3:.1f} ms)")
    return value


def main() -> int:
    ok = True
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"NVML cannot be initialised: {exc}")
        return 1
    timed("driver version", pynvml.nvmlSystemGetDriverVersion)
    timed("NVML version", pynvml.nvmlSystemGetNVMLVersion)
    print(f"nvidia-smi: {shutil.which('nvidia-smi')}")
    count = pynvml.nvmlDeviceGetCount()
    print(f"{count} GPU(s)")
    for i in range(count):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        bus = pynvml.nvmlDeviceGetPciInfo(h).busId
        print(f"GPU {i}: {uuid} {bus}")
        timed("name", lambda h=h: pynvml.nvmlDeviceGetName(h))
        timed("raw memory", lambda h=h: pynvml.nvmlDeviceGetMemoryInfo(h))
        timed("raw utilization", lambda h=h: pynvml.nvmlDeviceGetUtilizationRates(h))
        timed(
            "raw compute processes",
            lambda h=h: [
                (p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            ],
        )
        timed(
            "raw graphics processes",
            lambda h=h: [
                (p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
            ],
        )
        timed(
            "raw process utilization",
            lambda h=h: [
                (s.pid, s.smUtil, s.timeStamp) for s in pynvml.nvmlDeviceGetProcessUtilization(h, 0)
            ],
        )
        for device in (i, uuid, bus):
            sel = GpuSelector.parse(device)
            nvml = timed(
                f"vacancyd NVML capacity by {sel.kind}",
                lambda s=sel: read_nvml_capacity(NvmlGpu(s)),
            )
            ok = ok and nvml is not None
        smi = timed(
            "vacancyd nvidia-smi capacity", lambda i=i: SmiProbe(GpuSelector.parse(i), 5.0)()
        )
        if nvml is not None and smi is not None:
            agree = abs((nvml.total_mib or 0) - (smi.total_mib or 0)) <= 1
            print(f"  NVML and nvidia-smi agree on total memory: {agree}")
            ok = ok and agree
        probe = GpuPressureProbe(NvmlGpu(GpuSelector.parse(i)), {})
        first = timed("vacancyd pressure (first poll)", probe)
        time.sleep(1.0)
        second = timed("vacancyd pressure (1 s later)", probe)
        ok = ok and first is not None and second is not None
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
