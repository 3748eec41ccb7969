"""A job whose completion is uncertain when the real ``vacancyd run`` process stops is written
to ``holds.json`` as a hold before it exits, so the restarted daemon refuses its resource
until the hold is released by the usual rules: a llama-server (the fake in tests/support,
which keeps ``/slots`` busy after a disconnect) still generating for a borrower who left,
and an OpenAI-compatible stream cut by the stop (the server may go on with it)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp

from e2e.test_durable_holds import (
    _none_held,
    _ready,
    _saved,
    _saved_empty,
    free_port,
    held,
    start,
    status,
    until,
)
from tests.support.config import daemon_toml, upstream
from tests.support.daemon import serve_app
from tests.support.slow_openai import SlowOpenAI

STREAM = {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "x"}]}
SHORT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}


def config(api: int, proxy: int, target: str, state_dir: Path, **keys: Any) -> str:
    return daemon_toml(
        upstream("up", target, listen=f"127.0.0.1:{proxy}", **keys),
        # the drain lasts until the second signal, whatever is in flight
        server={"listen": f"127.0.0.1:{api}", "shutdown_grace_s": 30, "shutdown_delay_s": 30},
        collectors={"poll_s": 0.2},
        state_dir=state_dir,
    )


async def stop_twice(daemon: asyncio.subprocess.Process) -> str:
    """SIGTERM, then SIGTERM again (the drain ends now); the exit status is 0. Returns what
    the process wrote to stderr."""
    daemon.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    daemon.send_signal(signal.SIGTERM)
    assert daemon.stderr is not None
    err = await asyncio.wait_for(daemon.stderr.read(), 20)
    assert await asyncio.wait_for(daemon.wait(), 20) == 0
    return err.decode(errors="replace")


async def borrow(http: aiohttp.ClientSession, proxy: str) -> tuple[int, str]:
    async with http.post(proxy + "/v1/chat/completions", json=SHORT) as r:
        if r.status == 200:
            return 200, ""
        return r.status, (await r.json())["error"]["code"]


async def test_detached_llamacpp_work_tracked_at_the_stop_is_held_across_the_restart(
    tmp_path: Path,
) -> None:
    stops = asyncio.Event()
    fake = SlowOpenAI(chunks=400, interval_s=0.02, detached_busy=stops)
    api_port, proxy_port = free_port(), free_port()
    api, proxy = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{proxy_port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    state_dir = tmp_path / "state"
    async with serve_app(fake.app()) as target, aiohttp.ClientSession() as http:
        path = tmp_path / "vacancyd.toml"
        toml = config(
            api_port, proxy_port, target, state_dir, adapter="llamacpp", detached_work_timeout_s=5
        )
        path.write_text(toml, encoding="utf-8")
        daemon = await start(path, env)
        try:
            await until("ready", lambda: _ready(http, api))
            stream = await http.post(proxy + "/v1/chat/completions", json=STREAM)
            assert stream.status == 200
            await stream.content.readline()
            stream.close()  # the borrower leaves; the fake's /slots stays busy

            async def tracking() -> bool:
                work = (await status(http, api))["upstreams"]["up"]["active_work"]
                return [w["phase"] for w in work] == ["tracking"]

            await until("tracking", tracking)
            err = await stop_twice(daemon)
            saved = await _saved(state_dir)
            assert saved is not None, err
            assert [h["reason"] for h in saved["holds"]] == ["detached_work"]

            daemon = await start(path, env)
            doc = await until("ready again", lambda: _ready(http, api))
            (job,) = held(doc)
            assert job["hold"]["reason"] == "detached_work"
            assert job["hold"]["release_by"] == "server_idle"
            assert await borrow(http, proxy) == (503, "resource_busy")
            stops.set()  # the server finishes; an idle /slots releases the hold
            await until("released", lambda: _none_held(http, api))
            assert await borrow(http, proxy) == (200, "")
        finally:
            if daemon.returncode is None:
                await stop_twice(daemon)


async def test_an_openai_stream_cut_by_the_stop_is_held_across_the_restart(
    tmp_path: Path,
) -> None:
    slow = SlowOpenAI(chunks=100_000, interval_s=0.05)
    api_port, proxy_port = free_port(), free_port()
    api, proxy = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{proxy_port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    state_dir = tmp_path / "state"
    async with serve_app(slow.app()) as target, aiohttp.ClientSession() as http:
        path = tmp_path / "vacancyd.toml"
        path.write_text(config(api_port, proxy_port, target, state_dir), encoding="utf-8")
        daemon = await start(path, env)
        try:
            await until("ready", lambda: _ready(http, api))
            stream = await http.post(proxy + "/v1/chat/completions", json=STREAM)
            assert stream.status == 200
            await stream.content.readline()
            err = await stop_twice(daemon)
            stream.close()
            saved = await _saved(state_dir)
            assert saved is not None, err
            assert [h["reason"] for h in saved["holds"]] == ["cut_uncertain"]
            assert "borrower_disconnected" not in err

            daemon = await start(path, env)
            doc = await until("ready again", lambda: _ready(http, api))
            (job,) = held(doc)
            assert (job["hold"]["reason"], job["hold"]["release_by"]) == ("cut_uncertain", "admin")
            assert await borrow(http, proxy) == (503, "resource_busy")
            async with http.post(f"{api}/admin/jobs/{job['job']}/release") as r:
                assert r.status == 200, await r.text()
            await until("released", lambda: _none_held(http, api))
            assert await borrow(http, proxy) == (200, "")
            await until("hold forgotten on disk", lambda: _saved_empty(state_dir))
        finally:
            if daemon.returncode is None:
                await stop_twice(daemon)
