"""Collector cost per poll: NVML (through the fake libnvidia-ml) versus nvidia-smi (stand-in).

Not a timed test: run it by hand and copy the figures into docs/benchmarks.md.

    .venv/bin/python bench/collector_cost.py [--polls N]

The script compiles tests/fakes/fake_nvml.c, then re-executes itself with LD_LIBRARY_PATH
pointing at it, so pynvml loads the fake through its normal library search. It reports wall
time and CPU time per call of:

* the capacity probe through NVML (memory + utilization of one GPU),
* the pressure probe through NVML (process lists, process utilization samples, and the
  psutil socket/process-tree scan for one local upstream target),
* the nvidia-smi fallback with a shell stand-in printing the real CSV (fork + exec + parse;
  the real nvidia-smi adds its own driver queries, typically tens of milliseconds).

The fake answers from a file, so NVML figures measure vacancyd's and pynvml's side only.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(name: str, fn: Callable[[], object], polls: int, children: bool = False) -> None:
    fn()  # warm: resolve handles, load the library
    walls = []
    usage = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    r0 = resource.getrusage(usage)
    cpu0 = time.process_time()
    for _ in range(polls):
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    r1 = resource.getrusage(usage)
    cpu = time.process_time() - cpu0
    if children:
        cpu += (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    walls.sort()
    p50, p95 = walls[len(walls) // 2], walls[int(len(walls) * 0.95)]
    print(
        f"{name:<34} polls={polls:<5} wall mean={statistics.mean(walls) * 1e3:7.3f} ms "
        f"p50={p50 * 1e3:7.3f} ms p95={p95 * 1e3:7.3f} ms "
        f"cpu/poll={cpu / polls * 1e3:7.3f} ms"
    )


def run(polls: int, work: Path) -> None:
    from tests.support.gpu import SMI_TWO_GPUS, Scenario
    from vacancyd.collectors.nvidia import (
        GpuPressureProbe,
        NvmlGpu,
        SmiProbe,
        read_nvml_capacity,
    )
    from vacancyd.core.gpu import GpuSelector

    scenario = Scenario(Path(os.environ["FAKE_NVML_SCENARIO"]))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    scenario.procs = [(0, "compute", os.getpid(), 4000), (0, "graphics", 4_000_000, 300)]
    for _ in range(8):
        scenario.sample(os.getpid(), 60)
        scenario.sample(4_000_000, 10)
    scenario.nofilter = False
    scenario.write()

    gpu = NvmlGpu(GpuSelector.parse(0))
    measure("nvml capacity", lambda: read_nvml_capacity(gpu), polls)
    pressure = GpuPressureProbe(gpu, {"llm": ("127.0.0.1", port)})
    measure("nvml pressure (1 local upstream)", pressure, max(1, polls // 4))
    bare = GpuPressureProbe(gpu, {})
    measure("nvml pressure (no upstream)", bare, max(1, polls // 4))

    smi_dir = work / "bin"
    smi_dir.mkdir()
    smi = smi_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '%s' '" + SMI_TWO_GPUS + "'\n")
    smi.chmod(0o755)
    probe = SmiProbe(GpuSelector.parse(0), 2.0, executable=str(smi))
    measure("nvidia-smi stand-in capacity", probe, max(1, polls // 10), children=True)
    listener.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--polls", type=int, default=2000)
    args = parser.parse_args()
    if "FAKE_NVML_SCENARIO" not in os.environ:
        from tests.support.gpu import Scenario, build_fake_nvml

        work = Path(tempfile.mkdtemp(prefix="vacancyd-bench-"))
        lib = build_fake_nvml(work)
        scenario = Scenario(work / "scenario.txt")
        scenario.write()
        env = dict(
            os.environ,
            LD_LIBRARY_PATH=str(lib.parent),
            FAKE_NVML_SCENARIO=str(scenario.path),
            BENCH_WORK=str(work),
        )
        raise SystemExit(subprocess.call([sys.executable, __file__, *sys.argv[1:]], env=env))
    run(args.polls, Path(os.environ["BENCH_WORK"]))


if __name__ == "__main__":
    main()
