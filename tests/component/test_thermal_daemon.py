"""A GPU's temperature and energy counter end to end in a real daemon over the fake NVML:
``gpu_too_hot`` refusals with hysteresis (503, Retry-After, the OpenAI-shaped error, /status,
metrics), running work yielded by the reclaim policy after ``hot_yield_after_s``, and the
energy counter read or missing (issue 23, item 6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.gpu import Gpu, Scenario
from tests.support.slow_openai import SlowOpenAI
from vacancyd.core import gate
from vacancyd.core.reasons import Reason


def config(state_dir: Path, target: str, on_owner_return: str | None = None, **keys: Any) -> str:
    """One upstream ``llm`` on the fake NVML's card 0 (pressure off), sampled every 100 ms."""
    return daemon_toml(
        upstream("llm", target, resource="gpu0", on_owner_return=on_owner_return),
        resources=(gpu("gpu0", 0, pressure={"enabled": False}, **keys),),
        collectors={"poll_s": 0.1},
        state_dir=state_dir,
    )


async def chat(d: RunningDaemon) -> tuple[int, dict[str, Any], str | None]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            d.proxy_url("llm") + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        ) as r,
    ):
        return r.status, await r.json(), r.headers.get("Retry-After")


async def status_and_metrics(d: RunningDaemon) -> tuple[dict[str, Any], str]:
    async with aiohttp.ClientSession() as s:
        async with s.get(d.api_url + "/status") as r:
            doc = await r.json()
        async with s.get(d.api_url + "/metrics") as r:
            metrics = await r.text()
    return doc, metrics


def heat(nvml: Scenario, celsius: int, energy_mj: int | None = None) -> None:
    nvml.gpus = [Gpu(temp_c=celsius, energy_mj=energy_mj)]
    nvml.write()


async def test_too_hot_refuses_with_hysteresis(nvml: Scenario, tmp_path: Path) -> None:
    heat(nvml, 60, energy_mj=5_000_000)
    app, _ = openai_like_app()
    async with (
        serve_app(app) as target,
        running_daemon(
            config(tmp_path / "state", target, max_temperature_c=80, temperature_resume_c=72)
        ) as d,
    ):
        await d.wait_ready()
        status, _, _ = await chat(d)
        assert status == 200
        tracker = d.state.thermal["gpu0"]

        heat(nvml, 85, energy_mj=5_250_000)
        await d.wait_until(lambda: tracker.hot, what="hot")
        status, body, retry = await chat(d)
        assert status == 503 and retry == "60"
        assert body["error"]["code"] == "gpu_too_hot"
        assert body["error"]["type"] == "no_vacancy"
        assert "85 °C" in body["error"]["message"]
        assert "below 72 °C" in body["error"]["message"]
        doc, metrics = await status_and_metrics(d)
        res = doc["resources"]["gpu0"]
        assert res["temperature_c"] == 85 and res["energy_j"] == 5250.0
        assert res["thermal"]["hot"] is True and res["thermal"]["max_c"] == 80
        assert res["lendable"] is False and "85 °C" in res["why_not"]
        assert doc["upstreams"]["llm"]["refusal"]["reason"] == "gpu_too_hot"
        assert 'vacancyd_gpu_temperature_celsius{resource="gpu0"} 85.0' in metrics
        assert 'vacancyd_gpu_energy_joules_total{resource="gpu0"} 5250.0' in metrics

        heat(nvml, 75)  # below the maximum, above the resume temperature
        await d.wait_until(lambda: tracker.temperature_c == 75, what="75 °C sampled")
        status, body, _ = await chat(d)
        assert status == 503 and body["error"]["code"] == "gpu_too_hot"

        heat(nvml, 71)
        await d.wait_until(lambda: not tracker.hot, what="cooled")
        status, _, _ = await chat(d)
        assert status == 200


async def test_energy_counter_missing_is_absent_not_zero(nvml: Scenario, tmp_path: Path) -> None:
    heat(nvml, 50, energy_mj=None)
    app, _ = openai_like_app()
    async with (
        serve_app(app) as target,
        running_daemon(config(tmp_path / "state", target)) as d,
    ):
        await d.wait_ready()
        doc, metrics = await status_and_metrics(d)
        assert doc["resources"]["gpu0"]["energy_j"] is None
        assert doc["resources"]["gpu0"]["temperature_c"] == 50
        assert doc["resources"]["gpu0"]["thermal"] is None
        assert "vacancyd_gpu_energy_joules_total{" not in metrics
        assert 'vacancyd_gpu_temperature_celsius{resource="gpu0"} 50.0' in metrics
        status, _, _ = await chat(d)
        assert status == 200  # no guard configured: temperature is only shown


async def test_staying_hot_yields_running_work(nvml: Scenario, tmp_path: Path) -> None:
    heat(nvml, 60)
    slow = SlowOpenAI(chunks=400, interval_s=0.05)
    async with (
        serve_app(slow.app()) as target,
        running_daemon(
            config(
                tmp_path / "state",
                target,
                on_owner_return="cancel",
                max_temperature_c=80,
                hot_yield_after_s=0.5,
            )
        ) as d,
    ):
        await d.wait_ready()
        events: list[tuple[str, dict[str, object]]] = []
        d.state.subscribe(lambda e: events.append((e.kind, e.payload())))
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                d.proxy_url("llm") + "/v1/chat/completions",
                json={"model": "tiny", "stream": True, "messages": []},
            )
            assert resp.status == 200
            await slow.started.wait()
            heat(nvml, 90)  # running work goes on for hot_yield_after_s, then is cut
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
            resp.release()
        await d.wait_until(lambda: slow.ended == ["disconnected"], what="upstream cut")
        view = d.state.reclaim_views["llm"]
        assert view["trigger"] == "thermal" and view["resource"] == "gpu0"
        changes = [e["change"] for k, e in events if k == "thermal"]
        assert changes == ["hot", "yield"]
        edge = next(e for k, e in events if k == "edge")
        assert edge["trigger"] == "thermal"
        # The cut job is held (the server may still be working: resource_busy first); the
        # card itself refuses as too hot.
        card = d.state.snapshot().resources["gpu0"]
        assert card.capacity.value is not None
        refusal = gate.decide_thermal(card.thermal, card.capacity.value.temperature_c, "gpu0")
        assert refusal is not None and refusal.reason is Reason.GPU_TOO_HOT
