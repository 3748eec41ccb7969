"""Shutdown: every proxy listener stops at
once with one bounded grace for in-flight work, new work is refused and /readyz is 503
from the first moment, and the API answers until the proxies are done."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from tests.support.config import daemon_toml, resource, upstream
from tests.support.daemon import RunningDaemon, serve_app
from tests.support.slow_openai import SlowOpenAI
from vacancyd.config import parse_config
from vacancyd.runtime.daemon import SHUTDOWN_GRACE_S, Daemon


def config(target: str, upstreams: int, state_dir: Path) -> str:
    # its own state directory: the streams cut at the stop are held and written out
    return daemon_toml(
        *(upstream(f"u{i}", target, resource=f"r{i}") for i in range(upstreams)),
        resources=tuple(resource(f"r{i}") for i in range(upstreams)),
        collectors={"poll_s": 0.2},
        server={"shutdown_grace_s": 3},
        state_dir=state_dir,
    )


async def test_listeners_stop_together_and_refuse_new_work(tmp_path: Path) -> None:
    slow = SlowOpenAI(chunks=10_000, interval_s=0.05)
    async with serve_app(slow.app()) as target:
        daemon = Daemon(parse_config(config(target, 4, tmp_path), "<test>"))
        await daemon.start()
        state = daemon.state
        await RunningDaemon(daemon).wait_ready()
        http = aiohttp.ClientSession()
        streams = []
        for i in range(3):
            resp = await http.post(
                f"http://{daemon.bound[f'u{i}']}/v1/chat/completions",
                json={"model": "m", "stream": True, "messages": []},
            )
            assert resp.status == 200
            streams.append(resp)
        # a keep-alive connection to the fourth listener, opened before the stop
        idle = f"http://{daemon.bound['u3']}/v1/models"
        async with http.get(idle) as r:
            assert r.status == 200

        started = time.monotonic()
        stopping = asyncio.get_running_loop().create_task(daemon.shutdown())
        await asyncio.sleep(0.3)
        assert not state.ready(state.clock())[0]
        async with aiohttp.ClientSession() as fresh:
            async with fresh.get(f"http://{daemon.bound['api']}/readyz") as r:
                assert r.status == 503
        try:
            async with http.post(
                f"http://{daemon.bound['u3']}/v1/chat/completions", json={"model": "m"}
            ) as r:
                assert r.status == 503
                body = await r.json()
                assert "shutting down" in body["error"]["message"]
        except aiohttp.ClientConnectionError:
            pass  # the listener may already have closed that connection: also a refusal
        await stopping
        elapsed = time.monotonic() - started
        # one shared grace for all three busy listeners, not one after another
        assert elapsed < 2 * SHUTDOWN_GRACE_S, elapsed
        for resp in streams:
            resp.close()
        await http.close()
