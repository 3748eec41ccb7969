"""GPU collectors against the fake libnvidia-ml (pynvml's real code) and real processes.

Capacity (by index, UUID, PCI bus id; errors → unknown, never a number),
several GPUs, process utilization samples, and local upstream trees subtracted by
(pid, start time); non-local targets select nothing) and the issue's bad-input list.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.support.gpu import Gpu, Scenario
from vacancyd.collectors.base import ProbeError
from vacancyd.collectors.nvidia import (
    GpuPressureProbe,
    NvmlGpu,
    ProcessTable,
    is_local_target,
    read_nvml_capacity,
)
from vacancyd.core.gpu import GpuSelector

TWO = [
    Gpu(0, "GPU-aaaaaaaa-0000-0000-0000-000000000000", "00000000:01:00.0", 24576, 2048, None, 30),
    Gpu(1, "GPU-bbbbbbbb-0000-0000-0000-000000000000", "00000000:41:00.0", 8192, 8000, None, 90),
]


@pytest.mark.parametrize(
    ("device", "total"),
    [
        (0, 24576),
        (1, 8192),
        ("GPU-BBBBBBBB-0000-0000-0000-000000000000", 8192),
        ("0000:41:00.0", 8192),
        ("01:00.0", 24576),
    ],
)
def test_capacity_selects_one_gpu_by_index_uuid_or_pci(
    nvml: Scenario, device: int | str, total: int
) -> None:
    nvml.gpus = TWO
    nvml.write()
    gpu = NvmlGpu(GpuSelector.parse(device))
    reading = read_nvml_capacity(gpu)
    assert reading.total_mib == total
    chosen = TWO[0] if total == 24576 else TWO[1]
    assert reading.used_mib == chosen.used_mib
    assert reading.free_mib == total - chosen.used_mib
    assert reading.utilization == chosen.util_pct / 100
    assert gpu.uuid == chosen.uuid


def test_no_matching_gpu_is_an_error(nvml: Scenario) -> None:
    with pytest.raises(ProbeError, match="no GPU matches"):
        read_nvml_capacity(NvmlGpu(GpuSelector.parse("GPU-ffffffff")))
    with pytest.raises(ProbeError, match="cannot select"):
        read_nvml_capacity(NvmlGpu(GpuSelector.parse(5)))


@pytest.mark.parametrize(
    ("call", "device"),
    [
        ("handle", 0),
        ("count", "GPU-x"),
        ("uuid", 0),
        ("pci", "0000:01:00.0"),
        ("memory", 0),
        ("util", 0),
    ],
)
@pytest.mark.parametrize("code", [15, 999, 9])
def test_nvml_errors_on_every_capacity_call_are_probe_errors(
    nvml: Scenario, call: str, device: int | str, code: int
) -> None:
    nvml.errors = {call: code}
    nvml.write()
    with pytest.raises(ProbeError):
        read_nvml_capacity(NvmlGpu(GpuSelector.parse(device)))


def test_init_failure_is_a_probe_error(nvml: Scenario) -> None:
    nvml.init = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    nvml.write()
    with pytest.raises(ProbeError, match="initialisation"):
        read_nvml_capacity(NvmlGpu(GpuSelector.parse(0)))


def test_gpu_lost_then_back(nvml: Scenario) -> None:
    gpu = NvmlGpu(GpuSelector.parse(0))
    assert read_nvml_capacity(gpu).total_mib == 24576
    nvml.lost = {0}
    nvml.write()
    with pytest.raises(ProbeError, match="GPU is lost"):
        read_nvml_capacity(gpu)
    with pytest.raises(ProbeError):
        read_nvml_capacity(gpu)  # re-resolving fails too while it is gone
    nvml.lost = set()
    nvml.write()
    assert read_nvml_capacity(gpu).total_mib == 24576


def test_implausible_memory_is_refused(nvml: Scenario) -> None:
    nvml.gpus = [Gpu(free_mib=99999)]
    nvml.write()
    with pytest.raises(ProbeError, match="implausible"):
        read_nvml_capacity(NvmlGpu(GpuSelector.parse(0)))


# -- pressure --------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    """A real process listening on a loopback port, with one child: an upstream's tree."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    code = (
        "import socket, subprocess, sys, time\n"
        f"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen()\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(c.pid, flush=True)\n"
        "kids = [c]\n"
        "for line in sys.stdin:\n"
        "    kids.append(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']))\n"
        "    print(kids[-1].pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.PIPE
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        yield proc, child, port
    finally:
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        for p in [*kids, psutil.Process(proc.pid)]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        proc.stdout.close()
        assert proc.stdin is not None
        proc.stdin.close()


def test_upstream_tree_is_subtracted(nvml: Scenario, server: tuple[Any, ...]) -> None:
    proc, child, port = server
    owner = 4_000_000  # a pid no process has here: the owner's game, say
    nvml.procs = [(0, "compute", child, 4000), (0, "graphics", owner, 200)]
    nvml.sample(child, 80)
    nvml.sample(proc.pid, 10)
    nvml.sample(owner, 25)
    nvml.write()
    probe = GpuPressureProbe(NvmlGpu(GpuSelector.parse(0)), {"llm": ("127.0.0.1", port)})
    reading = probe()
    att = reading.attribution
    assert att.owner_load == pytest.approx(0.25)
    assert att.borrower_load == pytest.approx(0.90)
    assert att.seen == {"llm": True}
    assert reading.gpu == Gpu().uuid
    # the next poll sees only samples newer than the last: none → no load, still valid
    again = probe().attribution
    assert again.owner_load == 0 and again.borrower_load == 0
    assert again.seen == {"llm": True}  # the child is still in the compute list


def test_remote_or_named_target_selects_no_local_process(
    nvml: Scenario, server: tuple[Any, ...]
) -> None:
    _, child, port = server
    nvml.sample(child, 60)
    nvml.write()
    for host in ("gpu-box.example", "192.0.2.10"):
        probe = GpuPressureProbe(NvmlGpu(GpuSelector.parse(0)), {"llm": (host, port)})
        att = probe().attribution
        assert att.owner_load == pytest.approx(0.60)  # counted as the owner's
        assert att.seen == {}
    assert not is_local_target("my-own-hostname", frozenset({"10.0.0.5"}))
    assert is_local_target("10.0.0.5", frozenset({"10.0.0.5"}))
    assert is_local_target("localhost", frozenset())


def test_process_exits_between_listing_and_reading(nvml: Scenario, server: tuple[Any, ...]) -> None:
    _, child, port = server
    nvml.sample(child, 50)
    nvml.write()

    class ExitsFirst(ProcessTable):
        def start_time(self, pid: int) -> float | None:
            if pid == child:
                victim = psutil.Process(child)
                victim.kill()
                deadline = time.monotonic() + 5
                while victim.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
                    time.sleep(0.01)
            return super().start_time(pid)

    probe = GpuPressureProbe(
        NvmlGpu(GpuSelector.parse(0)), {"llm": ("127.0.0.1", port)}, processes=ExitsFirst()
    )
    with pytest.raises(ProbeError, match="exited while read"):
        probe()


@pytest.mark.parametrize("call", ["compute", "graphics", "procutil"])
def test_nvml_errors_on_process_calls_are_probe_errors(nvml: Scenario, call: str) -> None:
    nvml.errors = {call: 999}
    nvml.write()
    with pytest.raises(ProbeError, match="process query"):
        GpuPressureProbe(NvmlGpu(GpuSelector.parse(0)), {})()


def test_lost_gpu_is_a_pressure_error(nvml: Scenario) -> None:
    probe = GpuPressureProbe(NvmlGpu(GpuSelector.parse(0)), {})
    probe()
    nvml.lost = {0}
    nvml.write()
    with pytest.raises(ProbeError):
        probe()


def test_timestamps_going_backwards_are_an_error(nvml: Scenario) -> None:
    nvml.nofilter = True  # a driver that returns samples older than asked for
    nvml.sample(4_000_001, 10)
    nvml.write()
    probe = GpuPressureProbe(NvmlGpu(GpuSelector.parse(0)), {})
    probe()
    nvml.samples = [(0, 4_000_001, 5, 10)]  # older than the one already seen
    nvml.write()
    with pytest.raises(ProbeError, match="backwards"):
        probe()


def test_probe_is_fast(nvml: Scenario) -> None:
    probe = GpuPressureProbe(NvmlGpu(GpuSelector.parse(0)), {})
    probe()
    started = time.perf_counter()
    for _ in range(20):
        probe()
    assert (time.perf_counter() - started) / 20 < 0.05


def test_trees_are_cached_and_a_new_child_is_attributed_on_first_sight(
    nvml: Scenario, server: tuple[Any, ...]
) -> None:
    proc, child, port = server
    probe = GpuPressureProbe(NvmlGpu(GpuSelector.parse(0)), {"llm": ("127.0.0.1", port)})
    nvml.sample(child, 30)
    nvml.sample(4_000_000, 20)
    nvml.write()
    probe()
    assert probe.scans == 1
    for _ in range(3):  # the same processes again: no new scan
        nvml.sample(child, 30)
        nvml.sample(4_000_000, 20)
        nvml.write()
        assert probe().attribution.owner_load == pytest.approx(0.2)
    assert probe.scans == 1
    proc.stdin.write(b"spawn\n")
    proc.stdin.flush()
    newcomer = int(proc.stdout.readline())  # the server starts a runner for borrowed work
    nvml.sample(newcomer, 60)
    nvml.write()
    att = probe().attribution
    assert probe.scans == 2
    assert att.borrower_load == pytest.approx(0.6)
    assert att.owner_load == 0


def test_reused_pid_counts_as_the_owners(nvml: Scenario, server: tuple[Any, ...]) -> None:
    """The tree was read with the child's start time; by the time its sample is attributed,
    the pid belongs to a process with another start time (it exited and the number was
    reused), so its load is the owner's and the trees are read again on the next poll."""
    _, child, port = server
    nvml.sample(child, 45)
    nvml.write()

    class Reused(ProcessTable):
        reused = False

        def start_time(self, pid: int) -> float | None:
            real = super().start_time(pid)
            if pid == child and self.reused and real is not None:
                return real + 1000.0
            return real

    table = Reused()
    probe = GpuPressureProbe(
        NvmlGpu(GpuSelector.parse(0)), {"llm": ("127.0.0.1", port)}, processes=table
    )
    assert probe().attribution.borrower_load == pytest.approx(0.45)
    table.reused = True
    nvml.sample(child, 45)
    nvml.write()
    att = probe().attribution
    assert att.owner_load == pytest.approx(0.45)
    assert att.borrower_load == 0
    assert att.seen == {"llm": False}
    assert probe._trees is None  # re-read next poll


# -- temperature and the energy counter ----------------------------------------------------


def test_capacity_carries_temperature_and_energy(nvml: Scenario) -> None:
    nvml.gpus = [Gpu(temp_c=67, energy_mj=86_400_123_456)]
    nvml.write()
    gpu = NvmlGpu(GpuSelector.parse(0))
    reading = read_nvml_capacity(gpu)
    assert reading.temperature_c == 67.0
    assert reading.energy_j == pytest.approx(86_400_123.456)
    nvml.gpus = [Gpu(temp_c=71, energy_mj=86_500_123_456)]
    nvml.write()
    later = read_nvml_capacity(gpu)
    assert later.temperature_c == 71.0
    assert later.energy_j is not None and reading.energy_j is not None
    assert later.energy_j - reading.energy_j == pytest.approx(100_000.0)  # cumulative


def test_a_card_without_energy_counter_or_sensor_reads_none(nvml: Scenario) -> None:
    nvml.gpus = [Gpu(temp_c=None, energy_mj=None)]
    nvml.write()
    reading = read_nvml_capacity(NvmlGpu(GpuSelector.parse(0)))
    assert reading.energy_j is None and reading.temperature_c is None
    assert reading.total_mib == 24576  # memory is read all the same


def test_a_failing_sensor_leaves_memory_measured(
    nvml: Scenario, caplog: pytest.LogCaptureFixture
) -> None:
    nvml.gpus = [Gpu(temp_c=60, energy_mj=5000)]
    nvml.errors = {"temp": 999, "energy": 999}
    nvml.write()
    gpu = NvmlGpu(GpuSelector.parse(0))
    for _ in range(3):
        reading = read_nvml_capacity(gpu)
        assert reading.temperature_c is None and reading.energy_j is None
        assert reading.used_mib == 1024
    assert len([r for r in caplog.records if "temperature failed" in r.getMessage()]) == 1
    nvml.errors = {}
    nvml.write()
    assert read_nvml_capacity(gpu).temperature_c == 60.0
