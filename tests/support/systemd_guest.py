"""A real systemd, booted in a container, for the tests of the service and the package.

The root file system (Debian 12 with systemd, dbus and Python, no procps) is built once by
``tools/build-systemd-guest.sh`` into ``~/.cache/vacancyd-tools/systemd-guest`` (or
``$VACANCYD_TOOLS_CACHE``). Each :class:`Guest` boots it with ``systemd-nspawn -b`` on a
private overlay, so the cached tree is never changed and every test module starts from a
clean machine; ``--private-network`` gives it only its own loopback. Commands run inside
with ``nsenter`` into every namespace of the guest's PID 1 and a clean environment.

Without root, systemd-nspawn or the cached tree a test skips, or fails under
``VACANCYD_REQUIRE_TOOLS=1`` (CI), so a missing guest can never pass silently.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("VACANCYD_TOOLS_CACHE", Path.home() / ".cache" / "vacancyd-tools"))
ROOTFS = CACHE / "systemd-guest" / "current" / "rootfs"
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def require_guest() -> Path:
    """The cached root file system; skips (fails under VACANCYD_REQUIRE_TOOLS=1) when a
    booted guest cannot be had here."""
    problem = None
    if os.geteuid() != 0:
        problem = "booting a systemd guest needs root"
    elif shutil.which("systemd-nspawn") is None or shutil.which("nsenter") is None:
        problem = "systemd-nspawn (systemd-container) is not installed"
    elif not (ROOTFS.parent / ".complete").exists():
        problem = f"no systemd guest at {ROOTFS} (tools/build-systemd-guest.sh builds it)"
    if problem is not None:
        if os.environ.get("VACANCYD_REQUIRE_TOOLS") == "1":
            pytest.fail(problem + " but VACANCYD_REQUIRE_TOOLS=1")
        pytest.skip(problem)
    return ROOTFS


class Guest:
    """One booted guest. ``path`` is its / as seen from the host (write files there before
    or after boot); :meth:`run` runs a command inside."""

    def __init__(self, work: Path, lower: Path) -> None:
        self.name = f"vacancyd-{uuid.uuid4().hex[:8]}"
        self.work = work
        self.lower = lower
        self.path = work / "merged"
        self.log = work / "console.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.pid1 = 0

    def mount(self) -> None:
        for d in ("upper", "overlay-work", "merged"):
            (self.work / d).mkdir(parents=True, exist_ok=True)
        options = (
            f"lowerdir={self.lower},upperdir={self.work / 'upper'},"
            f"workdir={self.work / 'overlay-work'}"
        )
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(self.path)], check=True
        )

    def boot(self, timeout_s: float = 60.0) -> None:
        """Boot and wait until systemd says the system is up (running or degraded)."""
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    "systemd-nspawn",
                    "-q",
                    "--register=no",
                    "--keep-unit",
                    "--private-network",
                    "--console=read-only",
                    "-D",
                    str(self.path),
                    "-M",
                    self.name,
                    "-b",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={"PATH": os.environ.get("PATH", GUEST_PATH), "SYSTEMD_LOG_LEVEL": "warning"},
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not self.pid1:
            if self.process.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the guest's init did not appear: {self.log.read_text()}")
            self.pid1 = self._find_pid1()
            time.sleep(0.05)
        while True:  # systemd's own socket appears a moment after PID 1 does
            state = self.run(
                ["systemctl", "is-system-running", "--wait"], check=False, timeout=timeout_s
            )
            early = state.stdout.strip() == "offline" or "Failed to connect" in state.stderr
            if not early or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if state.stdout.strip() not in ("running", "degraded"):
            raise RuntimeError(f"the guest did not boot: {state.stdout} {state.stderr}")

    def _find_pid1(self) -> int:
        """The host pid of the process that is PID 1 in the guest's pid namespace (a child
        of systemd-nspawn), or 0 before it exists."""
        assert self.process is not None
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            return 0
        for child in children:
            try:
                status = Path(f"/proc/{child.pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                fields = line.split()
                if fields[:1] == ["NSpid:"] and len(fields) > 2 and fields[-1] == "1":
                    return child.pid
        return 0

    def run(
        self,
        argv: list[str],
        *,
        check: bool = True,
        timeout: float = 120.0,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the guest as root with a clean environment."""
        done = subprocess.run(
            [
                "nsenter",
                "-t",
                str(self.pid1),
                "-a",
                "env",
                "-i",
                f"PATH={GUEST_PATH}",
                "HOME=/root",
                "LANG=C.UTF-8",
                *argv,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"in the guest, {' '.join(argv)} exited {done.returncode}:\n"
                f"{done.stdout}\n{done.stderr}"
            )
        return done

    def sh(self, script: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.run(["sh", "-ec", script], **kwargs)  # type: ignore[arg-type]

    def journal(self, unit: str = "vacancyd") -> str:
        return self.run(["journalctl", "-u", unit, "--no-pager", "-o", "cat"], check=False).stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show`` properties of ``unit``."""
        out = self.run(["systemctl", "show", unit, "-p", ",".join(props)]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(
        self, what: str, probe: str, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the shell ``probe`` until it succeeds (every 0.2 s); AssertionError naming
        ``what`` with the journal when it never does."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.sh(probe, check=False)
            if done.returncode == 0:
                return done
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what} did not happen within {timeout_s:g} s: {done.stdout} "
                    f"{done.stderr}\njournal:\n{self.journal()[-3000:]}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        # A guest whose nspawn is gone but whose init lives on (a stop during early boot)
        # is ended with its whole pid namespace.
        if self.pid1 and psutil.pid_exists(self.pid1):
            try:
                init = psutil.Process(self.pid1)
                init.kill()
                init.wait(timeout=10)
            except psutil.Error:
                pass
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.name}", ignore_errors=True)
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)


UPSTREAM_PORT = 8080
_UPSTREAM_UNIT = f"""[Unit]
Description=a stand-in OpenAI-compatible server for vacancyd init to find

[Service]
ExecStart=/usr/bin/python3 /usr/local/lib/fake_upstream.py {UPSTREAM_PORT}

[Install]
WantedBy=multi-user.target
"""


def add_upstream(root: Path) -> None:
    """Install (before boot) a unit serving an OpenAI-compatible stand-in on
    127.0.0.1:8080, so ``vacancyd init`` in the guest finds a server as on a real lender."""
    lib = root / "usr/local/lib"
    lib.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / "tests/support/fake_upstream.py", lib / "fake_upstream.py")
    units = root / "etc/systemd/system"
    (units / "fake-upstream.service").write_text(_UPSTREAM_UNIT)
    wants = units / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "fake-upstream.service").symlink_to("/etc/systemd/system/fake-upstream.service")


@contextmanager
def booted_guest(work: Path, setup: Callable[[Path], None] | None = None) -> Iterator[Guest]:
    """A guest booted from the cached tree; ``setup(root)`` writes files into it before
    boot. Stopped and unmounted afterwards."""
    guest = Guest(work, require_guest())
    guest.mount()
    try:
        if setup is not None:
            setup(guest.path)
        guest.boot()
        yield guest
    finally:
        guest.stop()


@contextmanager
def built_package(work: Path) -> Iterator[tuple[Path, Path]]:
    """(the .deb built by tools/build-deb from this checkout, the wheelhouse it was made
    of). Fails with the build's output when the build fails."""
    wheels = work / "wheels"
    done = subprocess.run(
        [str(ROOT / "tools" / "build-deb"), str(work / "dist")],
        env={**os.environ, "WHEELHOUSE": str(wheels)},
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"tools/build-deb failed ({done.returncode}):\n{done.stderr[-4000:]}")
    yield Path(done.stdout.strip().splitlines()[-1]), wheels
