"""``presence = "headless"`` on a machine where someone sits at the desk: logind (the
look-alike on a private bus) lists a local graphical session, and ``check-config`` and the
daemon's start warn that headless lends while the owner is there. A remote (SSH) session
alone is no desk, and gets no warning."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.dbus import PrivateBus, private_bus
from tests.support.fake_logind import FakeLogind, SessionSpec

pytestmark = pytest.mark.dbus

DESK = SessionSpec("2", type="wayland", user="owner")
SSH = SessionSpec("5", type="tty", remote=True, remote_host="10.0.0.9", user="owner")


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[PrivateBus]:
    with private_bus(tmp_path) as running:
        yield running


def headless(address: str, target: str = "http://127.0.0.1:9") -> str:
    return daemon_toml(
        upstream("llm", target), owner={"presence": "headless", "bus_address": address}
    )


async def check_config(config: Path) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vacancyd",
        "check-config",
        str(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode() + err.decode()


@pytest.mark.parametrize(
    ("sessions", "warned"),
    [([DESK], True), ([SSH], False), ([], False)],
    ids=["desk", "ssh", "none"],
)
async def test_check_config_warns_when_headless_meets_a_local_desktop(
    bus: PrivateBus, tmp_path: Path, sessions: list[SessionSpec], warned: bool
) -> None:
    fake = await FakeLogind.start(bus.address, sessions)
    try:
        config = tmp_path / "v.toml"
        config.write_text(headless(bus.address))
        code, output = await check_config(config)
    finally:
        await fake.stop()
    assert code == 0, output  # a warning, not an error
    assert ('warning: presence is "headless"' in output) is warned, output
    if warned:
        assert "session 2 of owner (wayland)" in output and 'presence = "auto"' in output


async def test_daemon_start_warns_when_headless_meets_a_local_desktop(
    bus: PrivateBus, caplog: pytest.LogCaptureFixture
) -> None:
    fake = await FakeLogind.start(bus.address, [DESK])
    try:
        async with serve_app(openai_like_app()[0]) as target:
            with caplog.at_level(logging.WARNING, logger="vacancyd.runtime.loops"):
                async with running_daemon(headless(bus.address, target)):
                    for _ in range(100):
                        if any("headless" in r.getMessage() for r in caplog.records):
                            break
                        await asyncio.sleep(0.05)
    finally:
        await fake.stop()
    warnings = [r.getMessage() for r in caplog.records if "headless" in r.getMessage()]
    assert warnings and "session 2 of owner (wayland)" in warnings[0], caplog.text
