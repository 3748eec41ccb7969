"""The ``vacancyd`` process as an operator runs it: JSON logs (every line a JSON object with
an RFC 3339 UTC time, an access line per proxied request in the shape the API's lines have
too) and the systemd watchdog pings."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

from e2e.test_daemon_process import free_port, proc_env, vacancyd, wait_for
from tests.support.daemon import single_upstream_toml
from vacancyd.web.access import FIELDS

__all__ = ["proc_env"]  # the fixture, shared with test_daemon_process


def request(url: str, method: str = "GET", body: bytes | None = None) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=body, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with opener.open(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_json_logs_every_line_and_an_access_line_per_request(
    tmp_path: Path, proc_env: dict[str, str]
) -> None:
    api, proxy = free_port(), free_port()
    cfg = tmp_path / "v.toml"
    cfg.write_text(
        single_upstream_toml(
            api=api,
            proxy=proxy,
            target=f"http://127.0.0.1:{free_port()}",
            state_dir=tmp_path / "state",
        )
    )
    p = subprocess.Popen(
        vacancyd("run", "--config", str(cfg), "--log-format", "json"),
        env=proc_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(f"http://127.0.0.1:{api}/readyz")
        chat = f"http://127.0.0.1:{proxy}/v1/chat/completions"
        body = b'{"model": "m", "messages": []}'
        assert request(chat, "POST", body) == 502  # nothing listens at the target
        assert request(f"http://127.0.0.1:{api}/admin/lending", "PUT", b'{"enabled": false}') == 200
        assert request(chat, "POST", body) == 503
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    lines = [line for line in out.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # fails on the first non-JSON line
    assert all({"level", "name", "message"} <= r.keys() for r in records)
    access = [r for r in records if r["name"] == "vacancyd.access.up"]
    assert [(r["status"], r["route_class"], r["reason"]) for r in access] == [
        (502, "work", None),
        (503, "work", "lending_disabled"),
    ]
    assert all(r["level"] == "INFO" and r["duration_s"] >= 0 for r in access)
    assert "reason=lending_disabled" in access[1]["message"]
    # one shape for every listener's access line, and RFC 3339 UTC times on every line
    api_lines = [r for r in records if r["name"] == "vacancyd.access.api"]
    assert api_lines and all(r["route_class"] == "api" for r in api_lines)
    for r in access + api_lines:
        assert list(r)[4:] == list(FIELDS)
    assert all(
        re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["asctime"]) for r in records
    )


def test_watchdog_pings_from_the_event_loop(tmp_path: Path, proc_env: dict[str, str]) -> None:
    cfg = tmp_path / "v.toml"
    cfg.write_text(
        single_upstream_toml(
            api=free_port(),
            proxy=free_port(),
            target=f"http://127.0.0.1:{free_port()}",
            state_dir=tmp_path / "state",
        )
    )
    sock_path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(sock_path)
        sock.settimeout(20)
        # WatchdogSec=0.4 s: a ping every 0.2 s
        env = {**proc_env, "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "400000"}
        p = subprocess.Popen(
            vacancyd("run", "--config", str(cfg)),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:

            def recv() -> str:  # STATUS= updates (the service status line) may come between
                while (message := sock.recv(4096).decode()).startswith("STATUS="):
                    pass
                return message

            messages = [recv() for _ in range(5)]
            assert messages[0].startswith("READY=1")
            assert messages[1:] == ["WATCHDOG=1"] * 4
            p.send_signal(signal.SIGTERM)
            while (msg := recv()) == "WATCHDOG=1":
                pass
            assert msg == "STOPPING=1"
            p.communicate(timeout=15)
            assert p.returncode == 0
        finally:
            if p.poll() is None:
                p.kill()
