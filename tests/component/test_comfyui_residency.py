"""ComfyUI's allocator credit end to end: a daemon gating a GPU (fake NVML) in front of the
look-alike ComfyUI, whose prompts make torch's allocator reserve memory that it keeps for
the next prompt and that the fake GPU's free memory loses."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.fake_comfyui import FakeComfy
from tests.support.gpu import Gpu, Scenario

WORKFLOW = {"3": {"class_type": "KSampler", "inputs": {"seed": 1}}}


def config(target: str, also_requires: list[str] | None = None) -> str:
    """One ComfyUI upstream on card 0 of two (pressure off); 11,000 MiB a prompt by default."""
    return daemon_toml(
        upstream(
            "up",
            target,
            adapter="comfyui",
            resource="gpu0",
            also_requires=also_requires,
            models={"default_mib": 11000},
        ),
        resources=(
            gpu("gpu0", 0, pressure={"enabled": False}),
            gpu("gpu1", 1, pressure={"enabled": False}),
        ),
    )


def free_mib(d: RunningDaemon) -> float:
    value = d.state.capacity["gpu0"].value
    assert value is not None and value.free_mib is not None
    return value.free_mib


async def submit(d: RunningDaemon) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(d.proxy_url("up") + "/prompt", json={"prompt": WORKFLOW}) as r,
    ):
        return r.status, await r.json()


async def run_twice(
    nvml: Scenario, also_requires: list[str] | None = None
) -> tuple[int, dict[str, Any], FakeComfy]:
    nvml.gpus = [
        Gpu(total_mib=16_384, used_mib=512),
        Gpu(index=1, uuid="GPU-66666666-7777-8888-9999-000000000000", bus="00000000:02:00.0"),
    ]
    nvml.write()
    fake = FakeComfy(steps=2, step_s=0.05, scenario=nvml, prompt_mib=10_000)
    async with serve_app(fake.app()) as target, running_daemon(config(target, also_requires)) as d:
        await d.wait_ready()
        status, _ = await submit(d)
        assert status == 200
        await d.wait_until(lambda: not d.state.ledger.jobs(), 5)
        await d.wait_until(lambda: free_mib(d) < 6_000)
        status, body = await submit(d)
        if status == 200:
            await d.wait_until(lambda: not d.state.ledger.jobs(), 5)
        return status, body, fake


async def test_the_allocators_memory_is_credited_back_for_the_next_prompt(nvml: Scenario) -> None:
    status, body, fake = await run_twice(nvml)
    assert status == 200, body
    assert fake.reserved_mib == 10_000


async def test_no_credit_on_a_route_with_two_gpus(nvml: Scenario) -> None:
    status, body, _ = await run_twice(nvml, ["gpu1"])
    assert status == 503
    assert body["error"]["code"] == "insufficient_capacity"
    assert "no residency credit" in body["error"]["message"]
    assert "exactly one GPU" in body["error"]["message"]
