"""A careless operator's signals and files: SIGHUP never stops ``vacancyd run`` (it re-checks
the config and keeps the running one), and a FIFO, a device or a huge file as the config or
a token file is a clear error at once, never a hang or a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.config import daemon_toml, token
from tests.support.daemon import single_upstream_toml
from vacancyd.config import ConfigError, load_config, parse_config
from vacancyd.config.load import CONFIG_MAX_BYTES
from vacancyd.config.secrets import read_secrets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _wait(predicate: object, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def _config(api: int, state_dir: Path) -> str:
    return single_upstream_toml(
        api=api, proxy=0, target=f"http://127.0.0.1:{_free_port()}", state_dir=state_dir
    )


def test_sighup_rechecks_the_config_and_never_stops_the_daemon(tmp_path: Path) -> None:
    api = _free_port()
    config = tmp_path / "vacancyd.toml"
    config.write_text(_config(api, tmp_path / "state"), encoding="utf-8")
    log = tmp_path / "log.txt"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vacancyd", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        assert _wait(lambda: _healthy(api)), log.read_text()
        proc.send_signal(signal.SIGHUP)
        assert _wait(lambda: "is valid" in log.read_text()), log.read_text()
        assert proc.poll() is None and _healthy(api)

        config.write_text("[server]\nlisten = 12\n", encoding="utf-8")
        proc.send_signal(signal.SIGHUP)
        assert _wait(lambda: "server.listen" in log.read_text()), log.read_text()
        assert "ERROR" in log.read_text().split("is valid", 1)[1]
        assert proc.poll() is None and _healthy(api)
    finally:
        proc.terminate()
        rc = proc.wait(30)
    assert rc == 0, log.read_text()


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.timeout(20)
def test_a_fifo_or_device_config_is_refused_at_once(fifo: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError, match="FIFO"):
        load_config(fifo)
    with pytest.raises(ConfigError, match="character device"):
        load_config(Path("/dev/zero"))
    with pytest.raises(ConfigError, match="directory"):
        load_config(tmp_path)
    huge = tmp_path / "huge.toml"
    with huge.open("wb") as f:
        f.truncate(CONFIG_MAX_BYTES + 1)
    with pytest.raises(ConfigError, match="larger than 4 MiB"):
        load_config(huge)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(20)
def test_a_fifo_or_device_token_file_is_refused_at_once(fifo: Path) -> None:
    for path, what in ((fifo, "FIFO"), (Path("/dev/zero"), "character device")):
        settings = parse_config(
            daemon_toml(
                server={"listen": "127.0.0.1:0"},
                tokens=(token(None, "", "borrow", token_file=path),),
                resources=(),
                defaults=False,
            ),
            "<test>",
        )
        with pytest.raises(ConfigError, match=what):
            read_secrets(settings)


@pytest.mark.timeout(30)
def test_check_config_on_a_fifo_exits_with_the_reason(fifo: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vacancyd", "check-config", str(fifo)],
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert done.returncode != 0
    assert "FIFO" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
