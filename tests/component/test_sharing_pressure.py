"""GPU pressure refuses every waiting request at once with ``resource_pressured`` (sharing
issue), in a real daemon over the fake NVML."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.gpu import Scenario
from tests.support.held_openai import HeldOpenAI

OWNER_PID = 4_000_000


def config(state_dir: Path, target: str) -> str:
    """One upstream ``llm`` on the fake card 0 whose borrowers wait for a turn; the owner's
    GPU work above 20% engages pressure at once."""
    return daemon_toml(
        upstream(
            "llm",
            target,
            resource="gpu0",
            busy="wait",
            wait_timeout_s=30,
            on_owner_return="finish",
        ),
        resources=(
            gpu("gpu0", 0, pressure={"poll_ms": 100, "fixed_threshold": 0.2, "engage_after_s": 0}),
        ),
        collectors={"poll_s": 0.2},
        state_dir=state_dir,
    )


async def chat(d: RunningDaemon, client: aiohttp.ClientSession, user: str) -> tuple[int, Any]:
    async with client.post(
        d.proxy_url("llm") + "/v1/chat/completions",
        json={"model": "tiny", "user": user, "messages": [{"role": "user", "content": "hi"}]},
    ) as r:
        return r.status, await r.json()


async def test_pressure_refuses_every_waiter(nvml: Scenario, tmp_path: Path) -> None:
    fake = HeldOpenAI()
    async with (
        serve_app(fake.app()) as target,
        running_daemon(config(tmp_path / "state", target)) as d,
        aiohttp.ClientSession() as client,
    ):
        await d.wait_ready()
        first = asyncio.create_task(chat(d, client, "first"))
        await fake.until_arrived(1)
        queued = [asyncio.create_task(chat(d, client, f"w{i}")) for i in range(3)]
        await d.wait_until(lambda: d.daemon.waiting.waiting("llm") == 3)
        nvml.procs = [(0, "graphics", OWNER_PID, 3000)]
        nvml.sample(OWNER_PID, 70)
        nvml.write()
        answers = await asyncio.wait_for(asyncio.gather(*queued), 10)
        assert {(s, b["error"]["code"]) for s, b in answers} == {(503, "resource_pressured")}
        assert fake.arrived == ["first"]
        fake.release("first")
        assert (await first)[0] == 200
