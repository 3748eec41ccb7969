"""A private, real ``dbus-daemon`` for tests and benchmarks.

``private_bus(tmp_path)`` writes a session-bus-style configuration into ``tmp_path``, starts
``dbus-daemon --nofork --print-address`` on a unix socket there and yields its address. The
policy lets any local client own any name, so a test can play systemd-logind on it. Skips the
test when ``dbus-daemon`` is missing, unless ``VACANCYD_REQUIRE_TOOLS=1`` (then it fails).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


def dbus_daemon_path() -> str:
    """Path of ``dbus-daemon``; skips (or fails under VACANCYD_REQUIRE_TOOLS=1) without it."""
    found = shutil.which("dbus-daemon") or (
        "/usr/bin/dbus-daemon" if os.path.exists("/usr/bin/dbus-daemon") else None
    )
    if found is None:
        message = "dbus-daemon is not installed (Debian package 'dbus'); D-Bus tests skipped"
        if os.environ.get("VACANCYD_REQUIRE_TOOLS") == "1":
            pytest.fail(message + " but VACANCYD_REQUIRE_TOOLS=1")
        pytest.skip(message)
    return found


@dataclass
class PrivateBus:
    """A running private bus: its ``address``, and ``stop()`` to take it down mid-test."""

    address: str
    process: subprocess.Popen[str]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def private_bus(directory: Path) -> Iterator[PrivateBus]:
    """Run a private dbus-daemon with its socket in ``directory``; yields the running bus."""
    binary = dbus_daemon_path()
    socket = directory / "bus.sock"
    config = directory / "bus.conf"
    config.write_text(CONFIG.format(socket=socket), encoding="utf-8")
    proc = subprocess.Popen(
        [binary, f"--config-file={config}", "--nofork", "--print-address"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        if not address:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"dbus-daemon did not print an address: {err.strip()}")
        bus = PrivateBus(address, proc)
        yield bus
    finally:
        PrivateBus("", proc).stop()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
