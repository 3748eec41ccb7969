"""The fake NVML library and the stand-in nvidia-smi the GPU tests drive.

``build_fake_nvml`` compiles tests/fakes/fake_nvml.c with gcc into ``libnvidia-ml.so.1``
(soname included). ``preload`` maps it into this process by path; pynvml's own loader then
asks the dynamic linker for ``libnvidia-ml.so.1`` by name and glibc hands it the already
loaded object with that soname, so pynvml's real code runs against it. Subprocesses find it
through ``LD_LIBRARY_PATH`` instead (glibc reads that only at process start).

``Scenario`` writes the file the fake re-reads on every call; ``write_smi`` writes an
executable ``nvidia-smi`` stand-in.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

FAKE_SOURCE = Path(__file__).resolve().parent.parent / "fakes" / "fake_nvml.c"
_preloaded: ctypes.CDLL | None = None


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile the fake into ``out_dir/libnvidia-ml.so.1``. Raises RuntimeError without gcc."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError(
            "gcc is required to build the fake libnvidia-ml.so.1 for the GPU tests "
            "(apt-get install gcc)"
        )
    out = out_dir / "libnvidia-ml.so.1"
    subprocess.run(
        [
            gcc,
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            str(out),
            str(FAKE_SOURCE),
        ],
        check=True,
        capture_output=True,
    )
    return out


def preload(library: Path) -> None:
    """Map the fake into this process once (see the module docstring)."""
    global _preloaded
    if _preloaded is None:
        _preloaded = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


@dataclass
class Gpu:
    index: int = 0
    uuid: str = "GPU-11111111-2222-3333-4444-555555555555"
    bus: str = "00000000:01:00.0"
    total_mib: int = 24576
    used_mib: int = 1024
    free_mib: int | None = None
    util_pct: int = 5
    #: °C (None: the card has no temperature sensor, NVML_ERROR_NOT_SUPPORTED).
    temp_c: int | None = None
    #: Cumulative energy in mJ since the driver loaded (None: NVML_ERROR_NOT_SUPPORTED).
    energy_mj: int | None = None
    #: Power limits in mW: (default, min, max); None: the power calls are not supported.
    power_mw: tuple[int, int, int] | None = None

    def lines(self) -> list[str]:
        free = self.total_mib - self.used_mib if self.free_mib is None else self.free_mib
        out = [
            f"gpu {self.index} {self.uuid} {self.bus} {self.total_mib} {self.used_mib} "
            f"{free} {self.util_pct}"
        ]
        if self.temp_c is not None:
            out.append(f"temp {self.index} {self.temp_c}")
        if self.energy_mj is not None:
            out.append(f"energy {self.index} {self.energy_mj}")
        if self.power_mw is not None:
            out.append(f"power {self.index} {' '.join(str(v) for v in self.power_mw)}")
        return out


@dataclass
class Scenario:
    """What the fake NVML reports. ``write()`` after each change; the fake re-reads it."""

    path: Path
    gpus: list[Gpu] = field(default_factory=lambda: [Gpu()])
    procs: list[tuple[int, str, int, int]] = field(default_factory=list)  # gpu, kind, pid, MiB
    samples: list[tuple[int, int, int, int]] = field(default_factory=list)  # gpu, pid, ts, sm%
    errors: dict[str, int] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    init: int = 0
    nofilter: bool = False
    #: The effective uid the fake's nvmlDeviceSetPowerManagementLimit checks (None: the
    #: process's own); anything but 0 is refused NVML_ERROR_NO_PERMISSION.
    euid: int | None = None
    _ts: int = 1_000_000

    @property
    def limits_path(self) -> Path:
        """Where the fake keeps the power limits set on it (they outlive ``write()``)."""
        return self.path.with_name(self.path.name + ".limits")

    def power_limit_mw(self, index: int = 0) -> int | None:
        """The power limit set on GPU ``index`` (mW), or None while it has its default."""
        if not self.limits_path.exists():
            return None
        limit = None
        for line in self.limits_path.read_text(encoding="utf-8").splitlines():
            gpu, mw = line.split()
            if int(gpu) == index:
                limit = int(mw)
        return limit

    def sample(self, pid: int, sm_pct: int, gpu: int = 0) -> None:
        """Append a process utilization sample with a fresh (increasing) timestamp."""
        self._ts += 100_000
        self.samples.append((gpu, pid, self._ts, sm_pct))

    def write(self) -> None:
        lines = [f"init {self.init}"]
        lines += [line for g in self.gpus for line in g.lines()]
        lines += [f"lost {i}" for i in sorted(self.lost)]
        lines += [f"err {call} {code}" for call, code in self.errors.items()]
        lines += [f"proc {g} {kind} {pid} {mib}" for g, kind, pid, mib in self.procs]
        lines += [f"sample {g} {pid} {ts} {sm}" for g, pid, ts, sm in self.samples]
        if self.nofilter:
            lines.append("nofilter")
        if self.euid is not None:
            lines.append(f"euid {self.euid}")
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(self.path)


def write_smi(directory: Path, body: str) -> Path:
    """Write an executable ``nvidia-smi`` Python script whose body is ``body``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia-smi"
    path.write_text(f"#!{sys.executable}\nimport sys, time, os\n{body}\n", encoding="utf-8")
    path.chmod(0o755)
    return path


#: nvidia-smi's real output for the query vacancyd makes, two GPUs (nounits: MiB and %).
SMI_TWO_GPUS = (
    "0, GPU-11111111-2222-3333-4444-555555555555, 00000000:01:00.0, 24576, 1024, 23552, 7\n"
    "1, GPU-66666666-7777-8888-9999-000000000000, 00000000:02:00.0, 12288, 12000, 288, "
    "[N/A]\n"
)
