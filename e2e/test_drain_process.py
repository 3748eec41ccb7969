"""``vacancyd run`` as a process, stopped by real signals: after SIGTERM it keeps answering
(new work refused with 503 ``shutting_down``, /readyz 503) while a borrowed stream goes on;
a second signal (SIGINT here) ends the drain at once, cutting the stream with a reset, and
the process still exits 0; /events followers get ``stopping`` and then ``shutdown``."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.config import daemon_toml, upstream
from tests.support.slow_openai import SlowOpenAI
from vacancyd.runtime.daemon import CLOSE_TIMEOUT_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def slow_upstream() -> Iterator[str]:
    """A streaming OpenAI-shaped server on its own thread and loop; yields its base URL."""
    port = free_port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    runner: web.AppRunner | None = None

    async def serve() -> None:
        nonlocal runner
        runner = web.AppRunner(SlowOpenAI(chunks=100_000, interval_s=0.05).app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def request(
    port: int, method: str, path: str, body: dict[str, object] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def logged_at(log: str, text: str) -> float:
    """When the daemon logged the first line holding ``text`` (epoch seconds, from the
    line's RFC 3339 timestamp). Raises AssertionError when no line holds it."""
    for line in log.splitlines():
        if text in line:
            stamp = line.split(" ", 1)[0].replace("Z", "+00:00")
            return datetime.fromisoformat(stamp).timestamp()
    raise AssertionError(f"no log line holds {text!r}:\n{log}")


def test_sigterm_drains_and_a_second_signal_ends_it_now(tmp_path: Path, slow_upstream: str) -> None:
    api, proxy = free_port(), free_port()
    config = tmp_path / "vacancyd.toml"
    config.write_text(
        daemon_toml(
            upstream("chat", slow_upstream, listen=f"127.0.0.1:{proxy}"),
            server={"listen": f"127.0.0.1:{api}", "shutdown_grace_s": 60},
            collectors={"poll_s": 0.2},
            state_dir=tmp_path / "state",
        )
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "vacancyd", "run", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if request(api, "GET", "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.1)
        events = socket.create_connection(("127.0.0.1", api), timeout=10)
        events.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        stream = http.client.HTTPConnection("127.0.0.1", proxy, timeout=10)
        stream.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps({"model": "m", "stream": True, "messages": []}),
            headers={"Content-Type": "application/json"},
        )
        reply = stream.getresponse()
        assert reply.status == 200
        assert reply.read1(65536).startswith(b"data: ")  # the stream flows

        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert p.poll() is None  # draining, not gone
        status, headers, body = request(proxy, "POST", "/v1/chat/completions", {"model": "m"})
        assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
        assert headers["Retry-After"] == "10"
        assert request(api, "GET", "/readyz")[0] == 503
        assert reply.read1(65536)  # the borrowed stream still flows during the grace

        began = time.monotonic()
        p.send_signal(signal.SIGINT)  # the second signal, of either kind
        out, _ = p.communicate(timeout=15)
        assert time.monotonic() - began < 10  # not the 60 s grace
        assert p.returncode == 0, out
        # From the second signal to the end of the stop, by the daemon's own log: nothing
        # waits out the listeners' close timeout (the cut stream's connection is reset at
        # once, on uvloop too), so the stop ends within it.
        hurried = logged_at(out, "second stop signal: ending the drain now")
        assert logged_at(out, "stopped ") - hurried < CLOSE_TIMEOUT_S, out
        # the stream was cut with a reset: never a clean end, nor one that looks like it
        with pytest.raises(ConnectionResetError):
            while reply.read1(65536):
                pass
        stream.close()
        seen = b""
        while chunk := events.recv(65536):
            seen += chunk
        events.close()
        text = seen.decode()
        assert "event: stopping" in text
        last = text.rstrip().rsplit("event: ", 1)[1]
        assert last.startswith("shutdown\n"), text[-300:]
        assert '"hurried":true' in last and '"cut":1' in last
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
