"""NVIDIA GPU capacity and per-process pressure.

Capacity: free, used and total memory (MiB), utilization (0–1), temperature (°C) and the
cumulative energy counter (joules; None on cards without one) of one declared GPU,
selected by NVML index, UUID (``GPU-…``) or PCI bus id (``0000:01:00.0``), read through
nvidia-ml-py's ``pynvml``. When the NVML library cannot be loaded at all, capacity falls back
to ``nvidia-smi --query-gpu`` CSV, run with a hard deadline and killed past it.

Pressure (Linux): NVML's per-process utilization samples and running compute/graphics
process lists for the selected GPU, split between the owner and the processes serving local
upstream targets (:func:`vacancyd.core.pressure.attribute_load`). There is no per-process
utilization without NVML, so under the nvidia-smi fallback pressure is unknown and refuses.

Every failure raises :class:`~vacancyd.collectors.base.ProbeError`: the reading becomes
unknown and vacancyd never makes up a number (docs/architecture.md). NVML is initialised on
first use and again after a failure, so a driver that appears later, or a GPU that comes
back, is picked up.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import psutil
import pynvml

from vacancyd.collectors.base import ProbeError
from vacancyd.core.gpu import GpuSelector
from vacancyd.core.observations import CapacityReading
from vacancyd.core.powerlimit import PowerLimits
from vacancyd.core.pressure import Attribution, Identity, ProcessSample, attribute_load
from vacancyd.core.reasons import PowerLimitProblem

log = logging.getLogger(__name__)

MIB = 1024 * 1024
_nvml_lock = threading.Lock()

SMI_FIELDS = "index,uuid,pci.bus_id,memory.total,memory.used,memory.free,utilization.gpu"


class NvmlMissing(ProbeError):
    """The NVML library itself cannot be loaded (no driver, or not an NVIDIA host)."""


# -- NVML ---------------------------------------------------------------------------------


def _nvml_error(exc: pynvml.NVMLError) -> str:
    try:
        return str(exc)
    except Exception:  # pynvml formats with nvmlErrorString, which a broken library may lack
        return f"NVML error {getattr(exc, 'value', '?')}"


class NvmlGpu:
    """One selected GPU's NVML handle, shared by its capacity and pressure probes.

    Thread-safe: the two probes run in their own executor threads. ``uuid`` is the GPU's
    identity once resolved (the calibration cache is keyed by it).
    """

    def __init__(self, selector: GpuSelector) -> None:
        self.selector = selector
        self.uuid: str | None = None
        self._handle: object | None = None
        self._lock = threading.Lock()
        #: The newest error reading an optional figure (temperature, energy), per figure.
        self.optional_errors: dict[str, str] = {}

    def handle(self) -> object:
        """The NVML device handle. Raises NvmlMissing or ProbeError."""
        with self._lock:
            if self._handle is None:
                self._handle = self._resolve()
            return self._handle

    def invalidate(self) -> None:
        """Forget the handle after a failed call (GPU lost, driver reloaded)."""
        with self._lock:
            self._handle = None

    def _resolve(self) -> object:
        with _nvml_lock:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError_LibraryNotFound as exc:
                raise NvmlMissing(f"the NVML library cannot be loaded: {_nvml_error(exc)}") from exc
            except pynvml.NVMLError as exc:
                raise ProbeError(f"NVML initialisation failed: {_nvml_error(exc)}") from exc
        sel = self.selector
        try:
            if sel.kind == "index":
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(sel.value))
            else:
                handle = None
                for i in range(pynvml.nvmlDeviceGetCount()):
                    candidate = pynvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = pynvml.nvmlDeviceGetUUID(candidate)
                    pci = pynvml.nvmlDeviceGetPciInfo(candidate).busId
                    pci = pci.decode() if isinstance(pci, bytes) else str(pci)
                    if sel.matches(i, uuid, pci):
                        handle = candidate
                        break
                if handle is None:
                    raise ProbeError(f"no GPU matches device {sel}")
            self.uuid = str(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            raise ProbeError(f"cannot select GPU {sel}: {_nvml_error(exc)}") from exc
        return handle


def read_nvml_capacity(gpu: NvmlGpu) -> CapacityReading:
    """Free/used/total MiB and utilization (0–1) through NVML. Raises NvmlMissing, ProbeError."""
    handle = gpu.handle()
    try:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
            utilization: float | None = int(rates.gpu) / 100.0
        except pynvml.NVMLError_NotSupported:
            utilization = None
    except pynvml.NVMLError as exc:
        gpu.invalidate()
        raise ProbeError(f"NVML query of GPU {gpu.selector} failed: {_nvml_error(exc)}") from exc
    free, used, total = int(memory.free), int(memory.used), int(memory.total)
    if total <= 0 or not 0 <= free <= total or not 0 <= used <= total:
        raise ProbeError(
            f"NVML reported implausible memory for GPU {gpu.selector}: "
            f"free {free}, used {used}, total {total} bytes"
        )
    if utilization is not None and not 0.0 <= utilization <= 1.0:
        raise ProbeError(f"NVML reported utilization {utilization:.0%} for GPU {gpu.selector}")
    return CapacityReading(
        free_mib=free / MIB,
        total_mib=total / MIB,
        utilization=utilization,
        used_mib=used / MIB,
        temperature_c=_optional(gpu, "temperature", _read_temperature, handle),
        energy_j=_optional(gpu, "energy counter", _read_energy, handle),
    )


def _read_temperature(handle: object) -> float | None:
    celsius = int(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    # NVML's sensor is an unsigned °C; anything outside a card's range is no reading.
    return float(celsius) if 0 <= celsius <= 150 else None


def _read_energy(handle: object) -> float | None:
    return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)) / 1000.0  # mJ -> J


def _optional(
    gpu: NvmlGpu, what: str, read: Callable[[object], float | None], handle: object
) -> float | None:
    """A figure some cards lack (temperature, the energy counter): None where the card does
    not support it, and None (logged once per distinct error) where reading it fails, so a
    missing sensor never makes the memory reading unknown."""
    try:
        value = read(handle)
    except pynvml.NVMLError_NotSupported:
        return None
    except pynvml.NVMLError as exc:
        error = _nvml_error(exc)
        if gpu.optional_errors.get(what) != error:
            gpu.optional_errors[what] = error
            log.warning("GPU %s: reading its %s failed: %s", gpu.selector, what, error)
        return None
    gpu.optional_errors.pop(what, None)
    return value


# -- the power limit (lend_power_limit_w) ------------------------------------------------------


class PowerLimitError(ProbeError):
    """The driver did not read or take a power limit; ``problem`` says why in one word."""

    def __init__(self, problem: PowerLimitProblem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


_POWER_PROBLEMS: tuple[tuple[type[pynvml.NVMLError], PowerLimitProblem], ...] = (
    (pynvml.NVMLError_NoPermission, PowerLimitProblem.NO_PERMISSION),
    (pynvml.NVMLError_NotSupported, PowerLimitProblem.NOT_SUPPORTED),
    (pynvml.NVMLError_InvalidArgument, PowerLimitProblem.OUT_OF_RANGE),
)


class NvmlPowerControl:
    """One GPU's NVML power limit, in milliwatts. Blocking: call from a worker thread.

    Setting a limit needs root (the driver answers NVML_ERROR_NO_PERMISSION otherwise). Every
    failure raises :class:`PowerLimitError` with its :class:`PowerLimitProblem`.
    """

    def __init__(self, gpu: NvmlGpu) -> None:
        self.gpu = gpu

    def uuid(self) -> str:
        """The GPU's UUID (resolving it first). Raises PowerLimitError."""
        self._handle()
        return self.gpu.uuid or str(self.gpu.selector)

    def read(self) -> PowerLimits:
        """The limit in force, the default and the settable range. Raises PowerLimitError."""
        handle = self._handle()
        try:
            low, high = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
            return PowerLimits(
                current_mw=int(pynvml.nvmlDeviceGetPowerManagementLimit(handle)),
                default_mw=int(pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle)),
                min_mw=int(low),
                max_mw=int(high),
            )
        except pynvml.NVMLError as exc:
            raise self._error("reading the power limit", exc) from exc

    def set(self, mw: int) -> None:
        """Set the power limit to ``mw`` milliwatts. Raises PowerLimitError."""
        handle = self._handle()
        try:
            pynvml.nvmlDeviceSetPowerManagementLimit(handle, int(mw))
        except pynvml.NVMLError as exc:
            raise self._error(f"setting the power limit to {mw / 1000:g} W", exc) from exc

    def _handle(self) -> object:
        try:
            return self.gpu.handle()
        except ProbeError as exc:
            raise PowerLimitError(PowerLimitProblem.FAILED, str(exc)) from exc

    def _error(self, what: str, exc: pynvml.NVMLError) -> PowerLimitError:
        known = [problem for kind, problem in _POWER_PROBLEMS if isinstance(exc, kind)]
        if not known:
            self.gpu.invalidate()  # a lost GPU or a reloaded driver: resolve it again
        return PowerLimitError(
            known[0] if known else PowerLimitProblem.FAILED,
            f"GPU {self.gpu.selector}: {what} failed: {_nvml_error(exc)}",
        )


# -- nvidia-smi fallback --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SmiRow:
    index: int
    uuid: str
    pci_bus_id: str
    total_mib: float
    used_mib: float
    free_mib: float
    utilization: float | None


def parse_smi_csv(text: str) -> list[SmiRow]:
    """Parse ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`` output.

    Memory columns are MiB; utilization is a percentage, or ``[N/A]`` / ``[Not Supported]``
    (then None). Raises ValueError on anything else: a row that does not parse is never
    half-used.
    """
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != 7:
            raise ValueError(f"line {n}: expected 7 columns, got {len(cols)}: {line[:80]!r}")
        try:
            index = int(cols[0])
            total, used, free = (float(c) for c in cols[3:6])
        except ValueError:
            raise ValueError(f"line {n}: not a number where one belongs: {line[:80]!r}") from None
        util_text = cols[6]
        utilization: float | None
        if util_text.startswith("["):
            utilization = None
        else:
            try:
                utilization = float(util_text) / 100.0
            except ValueError:
                raise ValueError(f"line {n}: utilization {util_text[:20]!r}") from None
        if (
            total <= 0
            or not 0 <= free <= total
            or not 0 <= used <= total
            or (utilization is not None and not 0 <= utilization <= 1)
        ):
            raise ValueError(f"line {n}: implausible values: {line[:80]!r}")
        rows.append(SmiRow(index, cols[1], cols[2], total, used, free, utilization))
    if not rows:
        raise ValueError("no GPU rows")
    return rows


class SmiProbe:
    """Capacity of one GPU from ``nvidia-smi``, with a hard deadline (seconds).

    The child runs in its own process group and is killed with it past the deadline, so a
    hung nvidia-smi never outlives the poll.
    """

    def __init__(self, selector: GpuSelector, timeout_s: float, executable: str = "nvidia-smi"):
        self.selector = selector
        self.timeout_s = timeout_s
        self.executable = executable

    def __call__(self) -> CapacityReading:
        path = shutil.which(self.executable)
        if path is None:
            raise ProbeError(f"NVML cannot be loaded and {self.executable!r} is not on PATH")
        try:
            proc = subprocess.Popen(
                [path, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise ProbeError(f"cannot run {path}: {exc}") from exc
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            raise ProbeError(
                f"nvidia-smi exceeded its {self.timeout_s:g} s deadline and was killed"
            ) from None
        if proc.returncode != 0:
            why = (
                err.decode("utf-8", "replace").strip()[:200] or out.decode("utf-8", "replace")[:200]
            )
            raise ProbeError(f"nvidia-smi exited with {proc.returncode}: {why}")
        try:
            rows = parse_smi_csv(out.decode("utf-8", "replace"))
        except ValueError as exc:
            raise ProbeError(f"nvidia-smi printed output vacancyd cannot read: {exc}") from exc
        chosen = [r for r in rows if self.selector.matches(r.index, r.uuid, r.pci_bus_id)]
        if len(chosen) != 1:
            raise ProbeError(
                f"nvidia-smi lists {len(chosen)} GPUs matching device {self.selector}, not one"
            )
        row = chosen[0]
        return CapacityReading(
            free_mib=row.free_mib,
            total_mib=row.total_mib,
            utilization=row.utilization,
            used_mib=row.used_mib,
        )

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.kill()
        proc.communicate()


class GpuCapacityProbe:
    """Capacity: NVML when the library loads, else nvidia-smi. Call from one executor thread."""

    def __init__(self, gpu: NvmlGpu, smi: SmiProbe) -> None:
        self.gpu = gpu
        self.smi = smi
        self.source = "nvml"

    def __call__(self) -> CapacityReading:
        try:
            reading = read_nvml_capacity(self.gpu)
        except NvmlMissing as exc:
            if self.source != "nvidia-smi":
                log.warning("GPU %s: %s; using nvidia-smi for capacity", self.gpu.selector, exc)
                self.source = "nvidia-smi"
            return self.smi()
        if self.source != "nvml":
            log.info("GPU %s: NVML loaded; using it for capacity", self.gpu.selector)
            self.source = "nvml"
        return reading


# -- the processes serving local upstream targets -----------------------------------


def local_addresses() -> frozenset[str]:
    """Every IP address of this machine's interfaces (plus loopback)."""
    out = {"127.0.0.1", "::1"}
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (2, 10):  # AF_INET, AF_INET6
                out.add(a.address.split("%", 1)[0])
    return frozenset(out)


def is_local_target(host: str, addresses: frozenset[str]) -> bool:
    """True when ``host`` names this machine: a loopback address, ``localhost``, or an
    address of one of its interfaces. Any other host name is never local (docs/architecture.md): it
    could resolve anywhere, and a port on it selects no local process.
    """
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return ip.is_loopback or str(ip) in addresses


class ProcessTable:
    """psutil reads the pressure probe makes; a seam so tests can interpose on them."""

    def listening_pids(self, host: str, port: int) -> set[int]:
        """PIDs with a TCP socket listening on ``host:port`` (or a wildcard address).

        Raises ProbeError when a listening socket is found but its owner cannot be read.
        """
        want = {"localhost": {"127.0.0.1", "::1"}}.get(host, {host.strip("[]")})
        pids: set[int] = set()
        unreadable = False
        try:
            conns = psutil.net_connections(kind="tcp")
        except (psutil.AccessDenied, OSError) as exc:
            raise ProbeError(f"cannot read the socket table: {exc}") from exc
        for c in conns:
            if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != port:
                continue
            ip = c.laddr.ip.split("%", 1)[0]
            if ip in want or ip in ("0.0.0.0", "::"):
                if c.pid is None:
                    unreadable = True
                else:
                    pids.add(c.pid)
        if unreadable and not pids:
            raise ProbeError(
                f"the process listening on {host}:{port} cannot be identified (run vacancyd "
                "as the server's user or with CAP_SYS_PTRACE)"
            )
        return pids

    def tree(self, pid: int) -> set[Identity]:
        """``pid`` and its descendants as (pid, start time); empty if ``pid`` is gone."""
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return set()
        out = set()
        for p in procs:
            try:
                out.add((p.pid, p.create_time()))
            except psutil.NoSuchProcess:
                continue
        return out

    def start_time(self, pid: int) -> float | None:
        """The process's start time (epoch seconds), or None when it has exited (a zombie
        has exited too: it holds no GPU work, only an exit status for its parent)."""
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc.create_time()
        except psutil.NoSuchProcess:
            return None


@dataclass(frozen=True, slots=True)
class PressureReading:
    """One pressure poll of one GPU: the attribution and the GPU's identity (UUID)."""

    attribution: Attribution
    gpu: str


class GpuPressureProbe:
    """Pressure: per-process utilization of one GPU, with upstream trees subtracted.

    ``targets``: upstream name → (host, port) of its target. Only local targets select
    processes. Call from one executor thread.

    Finding a target's listening process reads the whole socket table, and its descendants
    the whole process table: tens of milliseconds of CPU on a busy host. So the trees are
    cached and read again only when they may have changed: a cached process died or was
    replaced (start time differs), a process on the GPU belongs to no known tree and is not
    a known owner process, or ``rescan_s`` seconds have passed. A new child that a server
    spawns for borrowed work is therefore attributed on the first poll that sees it on the
    GPU.
    """

    def __init__(
        self,
        gpu: NvmlGpu,
        targets: Mapping[str, tuple[str, int]],
        processes: ProcessTable | None = None,
        addresses: Callable[[], frozenset[str]] = local_addresses,
        clock: Callable[[], float] = time.monotonic,
        rescan_s: float = 60.0,
    ) -> None:
        self.gpu = gpu
        self.targets = dict(targets)
        self.processes = processes or ProcessTable()
        self._addresses = addresses
        self._clock = clock
        self.rescan_s = rescan_s
        self._last_ts = 0
        self._trees: dict[str, frozenset[Identity]] | None = None
        self._owners: dict[int, float | None] = {}
        self._scanned_at = 0.0
        self.scans = 0

    def _scan(self) -> dict[str, frozenset[Identity]]:
        self.scans += 1
        addresses = self._addresses()
        trees: dict[str, frozenset[Identity]] = {}
        for upstream, (host, port) in self.targets.items():
            if not is_local_target(host, addresses):
                continue
            ids: set[Identity] = set()
            for pid in self.processes.listening_pids(host, port):
                ids |= self.processes.tree(pid)
            trees[upstream] = frozenset(ids)
        return trees

    def _current_trees(self, active: set[int]) -> dict[str, frozenset[Identity]]:
        """The cached trees, re-read when they may be out of date (see the class doc)."""
        trees = self._trees
        now = self._clock()
        if trees is not None and now - self._scanned_at < self.rescan_s:
            known = {pid for ids in trees.values() for pid, _ in ids}
            for pid in active - known:
                if pid not in self._owners or self.processes.start_time(pid) != self._owners[pid]:
                    trees = None  # a process on the GPU no scan has classified
                    break
        if trees is not None and now - self._scanned_at < self.rescan_s:
            return trees
        trees = self._scan()
        known = {pid for ids in trees.values() for pid, _ in ids}
        self._owners = {pid: self.processes.start_time(pid) for pid in active - known}
        self._trees = trees
        self._scanned_at = now
        return trees

    def __call__(self) -> PressureReading:
        handle = self.gpu.handle()
        samples = self._read(handle)
        active = {s.pid for s in samples}
        trees = self._current_trees(active)
        tree_pids = {pid for ids in trees.values() for pid, _ in ids}
        # Read after listing: a tree process that exited or was replaced since shows here.
        start_times = {pid: self.processes.start_time(pid) for pid in tree_pids & active}
        result = attribute_load(samples, trees, start_times)
        if result.error is not None:
            self._trees = None
            raise ProbeError(f"GPU {self.gpu.selector}: {result.error}")
        if any(
            start_times.get(pid, started) != started
            for ids in trees.values()
            for pid, started in ids
        ):
            self._trees = None  # a tree pid was reused: read the trees again next poll
        return PressureReading(result, self.gpu.uuid or str(self.gpu.selector))

    def _read(self, handle: object) -> list[ProcessSample]:
        try:
            listed = [
                *pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
                *pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
            ]
            try:
                raw: Sequence[object] = pynvml.nvmlDeviceGetProcessUtilization(
                    handle, self._last_ts
                )
            except pynvml.NVMLError_NotFound:
                raw = []  # NVML's answer when no process has used the GPU since _last_ts
        except pynvml.NVMLError as exc:
            self.gpu.invalidate()
            raise ProbeError(
                f"NVML process query of GPU {self.gpu.selector} failed: {_nvml_error(exc)}"
            ) from exc
        by_pid: dict[int, list[float]] = defaultdict(list)
        newest = self._last_ts
        for s in raw:
            ts = int(getattr(s, "timeStamp", 0))
            sm = int(getattr(s, "smUtil", 0))
            if ts < self._last_ts:
                raise ProbeError(
                    f"GPU {self.gpu.selector}: NVML sample timestamps went backwards "
                    f"({ts} µs after {self._last_ts} µs)"
                )
            if not 0 <= sm <= 100:
                raise ProbeError(f"GPU {self.gpu.selector}: process utilization {sm}%")
            newest = max(newest, ts)
            by_pid[int(getattr(s, "pid", 0))].append(sm / 100.0)
        self._last_ts = newest
        out = [ProcessSample(pid, sum(v) / len(v)) for pid, v in by_pid.items()]
        out += [ProcessSample(int(p.pid), 0.0, listed=True) for p in listed]
        return out


# -- inventory (vacancyd init) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as ``vacancyd init`` lists it: NVML index, UUID, PCI bus id, total MiB."""

    index: int
    uuid: str
    pci_bus_id: str
    total_mib: float


def list_gpus(
    smi_timeout_s: float = 5.0, executable: str = "nvidia-smi"
) -> tuple[list[GpuInfo], str, str | None]:
    """Every GPU on the host: (gpus, source, why none) with source ``nvml`` or
    ``nvidia-smi``. Blocking (run it in a thread); never raises."""
    try:
        with _nvml_lock:
            pynvml.nvmlInit()
            try:
                gpus = []
                for i in range(pynvml.nvmlDeviceGetCount()):
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    gpus.append(
                        GpuInfo(
                            i,
                            str(pynvml.nvmlDeviceGetUUID(handle)),
                            str(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                            int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) / MIB,
                        )
                    )
            finally:
                pynvml.nvmlShutdown()
        return gpus, "nvml", None if gpus else "NVML lists no GPU"
    except pynvml.NVMLError as exc:
        nvml_why = f"NVML: {_nvml_error(exc)}"
    try:
        done = subprocess.run(
            [executable, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True,
            timeout=smi_timeout_s,
            check=False,
        )
    except FileNotFoundError:
        return [], "none", f"{nvml_why}; nvidia-smi is not installed"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], "none", f"{nvml_why}; nvidia-smi failed: {exc}"
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", "replace").strip()[:200]
        return [], "none", f"{nvml_why}; nvidia-smi exited {done.returncode}: {err}"
    try:
        rows = parse_smi_csv(done.stdout.decode("utf-8", "replace"))
    except ValueError as exc:
        return [], "none", f"{nvml_why}; nvidia-smi output unreadable: {exc}"
    return [GpuInfo(r.index, r.uuid, r.pci_bus_id, r.total_mib) for r in rows], "nvidia-smi", None
