"""Ollama residency credit end to end: a real daemon gating a GPU (fake NVML) in front of the
look-alike Ollama, whose loads and unloads move the GPU's free memory, with the real
``ollama`` package as the borrower.

The card is 16 GiB; the model takes about 14 GiB once loaded, and its configured footprint
is 14,500 MiB. The first request is charged the footprint; follow-ups that reuse the loaded
model are charged ``resident_min_free_mib``; requests that would make Ollama reload it are
charged the footprint again and refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import ollama
import pytest

from tests.support.config import daemon_toml, gpu, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.errors import error_fields
from tests.support.fake_ollama import FakeOllama, ModelSpec
from tests.support.gpu import Gpu, Scenario
from tests.support.lender import owner_returns, reclaim_view
from vacancyd.core.residency import ContextLearning

_EMPTY = ContextLearning()

BIG = ModelSpec(weights_mib=13_900, kv_mib_per_1k=100, digest="d1" * 32)


def config(
    target: str, state_dir: Path, *, footprints: Mapping[str, int] | None = None, **keys: Any
) -> str:
    """One Ollama upstream on card 0 (pressure off), 14,500 MiB a model unless
    ``footprints`` says otherwise, the owner's veto held for an hour; ``keys`` are more keys
    of the upstream."""
    return daemon_toml(
        upstream(
            "up",
            target,
            adapter="ollama",
            resource="gpu0",
            resident_min_free_mib=0,
            **keys,
            models={"default_mib": 14500, "footprint_mib": footprints},
        ),
        resources=(gpu("gpu0", 0, pressure={"enabled": False}),),
        owner={"release_after_s": 3600},
        state_dir=state_dir,
    )


@asynccontextmanager
async def world(
    nvml: Scenario, tmp_path: Path, *, extra: Mapping[str, Any] | None = None, **fake_kw: Any
) -> AsyncIterator[tuple[RunningDaemon, FakeOllama, ollama.AsyncClient]]:
    """A 16 GiB GPU, a fake Ollama charging it, a daemon in front, and a real client."""
    nvml.gpus = [Gpu(total_mib=16_384, used_mib=512)]
    nvml.write()
    fake_kw.setdefault("specs", {"big:latest": BIG})
    fake = FakeOllama(models=("big:latest",), scenario=nvml, tokens=2, **fake_kw)
    async with (
        serve_app(fake.app()) as target,
        running_daemon(config(target, tmp_path / "state", **(extra or {}))) as d,
    ):
        await d.wait_ready()
        borrower = ollama.AsyncClient(host=d.proxy_url("up"))
        try:
            yield d, fake, borrower
        finally:
            await borrower.close()  # type: ignore[no-untyped-call]


def free_mib(d: RunningDaemon) -> float:
    value = d.state.capacity["gpu0"].value
    assert value is not None and value.free_mib is not None
    return value.free_mib


async def status(d: RunningDaemon) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(d.api_url + "/status") as r:
        doc: dict[str, Any] = await r.json()
        return doc


async def refusal(d: RunningDaemon, body: dict[str, Any], path: str = "/api/generate") -> Any:
    async with aiohttp.ClientSession() as s, s.post(d.proxy_url("up") + path, json=body) as r:
        assert r.status == 503, await r.text()
        return error_fields(await r.json())


async def test_follow_ups_reuse_the_loaded_model_and_reloads_are_charged_in_full(
    nvml: Scenario, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "vacancyd.control.work")
    async with world(nvml, tmp_path) as (d, fake, borrower):
        await d.wait_until(lambda: free_mib(d) > 15_000)
        first = await borrower.generate(model="big", prompt="hi")
        assert first.done
        # One consistent world: the GPU lost what the model took.
        assert fake.loads == [("big:latest", 4096)]
        await d.wait_until(lambda: free_mib(d) < 2_000)

        # A follow-up of the same kind reuses the model: admitted, charged 0 MiB, logged.
        again = await borrower.generate(model="big", prompt="more")
        assert again.done
        assert fake.loads == [("big:latest", 4096)]  # no reload
        credited = [r.getMessage() for r in caplog.records if "residency credit" in r.getMessage()]
        assert credited and "big:latest" in credited[-1] and "charged 0 MiB" in credited[-1]

        # Another num_ctx would reload it: the full footprint is charged, and it does not fit.
        error = await refusal(d, {"model": "big", "prompt": "x", "options": {"num_ctx": 8192}})
        assert error["code"] == "insufficient_capacity"
        assert "no residency credit" in error["message"]
        assert "asks for num_ctx 8192" in error["message"]
        # So would a runner option other than num_ctx.
        error = await refusal(d, {"model": "big", "prompt": "x", "options": {"num_gpu": 20}})
        assert "num_gpu" in error["message"]
        # A /v1 request loads whatever Ollama picks for it: not known yet, charged in full.
        error = await refusal(
            d,
            {"model": "big", "messages": [{"role": "user", "content": "x"}]},
            "/v1/chat/completions",
        )
        assert "no request of its kind was seen to load" in error["message"]
        assert fake.loads == [("big:latest", 4096)]

        # An explicit num_ctx equal to the loaded context is a proof by itself.
        ok = await borrower.generate(model="big", prompt="x", options={"num_ctx": 4096})
        assert ok.done

        doc = await status(d)
        learned = doc["upstreams"]["up"]["learned_contexts"]["contexts"]
        assert {"digest": BIG.digest, "num_ctx": None, "dialect": "api", "loads": 4096} in learned
        models = doc["upstreams"]["up"]["server"]["models"]
        assert models[0]["name"] == "big:latest" and models[0]["expires_in_s"] > 250
        async with aiohttp.ClientSession() as s, s.get(d.api_url + "/metrics") as r:
            text = await r.text()
        assert (
            'vacancyd_residency_credits_total{outcome="applied",reason="resident",upstream="up"}'
            in text
        )
        assert (
            'vacancyd_residency_credits_total{outcome="denied",reason="context_mismatch",'
            'upstream="up"} 1.0' in text
        )


async def test_status_shows_the_credit_of_a_running_admission(
    nvml: Scenario, tmp_path: Path
) -> None:
    async with world(nvml, tmp_path, token_interval_s=0.3) as (d, fake, borrower):
        await borrower.generate(model="big", prompt="load it")
        fake.tokens = 10
        stream = await borrower.generate(model="big", prompt="long", stream=True)
        first = await anext(aiter(stream))
        assert first["response"] == "t0 "
        work = (await status(d))["upstreams"]["up"]["active_work"]
        assert len(work) == 1
        assert work[0]["charged_mib"] == 0
        assert work[0]["residency"]["applied"] is True
        assert work[0]["residency"]["code"] == "resident"
        async for _ in stream:
            pass


async def test_a_short_keep_alive_earns_no_credit(nvml: Scenario, tmp_path: Path) -> None:
    async with world(nvml, tmp_path) as (d, _fake, borrower):
        await borrower.generate(model="big", prompt="hi", keep_alive="5s")
        await d.wait_until(lambda: free_mib(d) < 2_000)
        error = await refusal(d, {"model": "big", "prompt": "again"})
        assert "Ollama unloads it in" in error["message"]
        # When the keep-alive passes, Ollama unloads it and the card is free again.
        await d.wait_until(lambda: free_mib(d) > 15_000, 30)


async def test_the_modelfile_num_ctx_proves_an_owner_loaded_model(
    nvml: Scenario, tmp_path: Path
) -> None:
    spec = ModelSpec(
        weights_mib=13_000, kv_mib_per_1k=100, digest="e2" * 32, modelfile_num_ctx=8192
    )
    async with world(nvml, tmp_path, specs={"big:latest": spec}) as (d, fake, borrower):
        # The owner loaded it directly (not through vacancyd): no learned context exists.
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                str(d.daemon.settings.upstream[0].target).rstrip("/") + "/api/generate",
                json={"model": "big"},
            ) as r,
        ):
            assert r.status == 200
        await d.wait_until(lambda: free_mib(d) < 3_000)
        await d.wait_until(
            lambda: spec.digest in d.state.learning.get("up", _EMPTY).modelfile_num_ctx
        )
        assert fake.show_requests == ["big:latest"]
        ok = await borrower.generate(model="big", prompt="x")
        assert ok.done and fake.loads == [("big:latest", 8192)]
        await asyncio.sleep(0.3)
        assert fake.show_requests == ["big:latest"]  # once per digest


async def test_parallel_slots_reporting_a_multiple_are_learned(
    nvml: Scenario, tmp_path: Path
) -> None:
    """Servers that report num_ctx × parallel slots (v0.10–v0.11.4): an explicit num_ctx
    never equals the loaded context, but the learned map remembers what it loads."""
    async with world(nvml, tmp_path, num_parallel=2, report_total_context=True) as (
        d,
        fake,
        borrower,
    ):
        spec = fake.spec("big:latest")
        fake.specs["big:latest"] = ModelSpec(13_000, 50, digest=spec.digest)
        await borrower.generate(model="big", prompt="x", options={"num_ctx": 4096})
        await d.wait_until(lambda: bool(d.state.learning.get("up", _EMPTY).contexts))
        ok = await borrower.generate(model="big", prompt="x", options={"num_ctx": 4096})
        assert ok.done and len(fake.loads) == 1
        assert d.state.learning["up"].shows_parallel_slots(spec.digest)


async def test_no_credit_from_an_observation_older_than_a_yield(
    nvml: Scenario, tmp_path: Path
) -> None:
    async with world(nvml, tmp_path, extra={"yield_on_veto": True}) as (d, fake, borrower):
        await borrower.generate(model="big", prompt="hi")
        await d.wait_until(lambda: free_mib(d) < 2_000)
        owner_returns(d)
        await d.wait_until(lambda: reclaim_view(d).get("phase") == "done")
        assert fake.loaded == {}
        await d.wait_until(lambda: free_mib(d) > 15_000)
        yielded = d.state.yielded_at["gpu0"]
        # The observations taken before the yield no longer count; the next one shows the
        # model gone.
        await d.wait_until(
            lambda: (
                (d.state.servers["up"].observed_at or 0) > yielded
                and d.state.servers["up"].value is not None
                and not d.state.servers["up"].value.models
            )
        )


async def test_api_ps_garbage_fails_the_observation_and_charges_in_full(
    nvml: Scenario, tmp_path: Path
) -> None:
    async with world(nvml, tmp_path) as (d, fake, borrower):
        await borrower.generate(model="big", prompt="hi")
        fake.ps_override = {"models": [{"name": "big:latest"}, {"name": "Big"}]}
        await d.wait_until(lambda: "twice" in (d.state.servers["up"].error or ""))
        error = await refusal(d, {"model": "big", "prompt": "again"})
        assert "newest server observation failed" in error["message"]
        assert "twice" in error["message"]
        fake.ps_override = b"<html>not json"
        await d.wait_until(lambda: "invalid JSON" in (d.state.servers["up"].error or ""))
        assert d.daemon.supervisor.failure is None


async def test_a_failing_api_show_costs_only_the_modelfile_credit(
    nvml: Scenario, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "vacancyd.adapters.ollama")
    async with world(nvml, tmp_path, show_fails=True) as (d, fake, borrower):
        await borrower.generate(model="big", prompt="hi")
        await d.wait_until(lambda: any("Modelfile" in r.getMessage() for r in caplog.records))
        # The observation itself is fine, and the learned context still proves residency.
        ok = await borrower.generate(model="big", prompt="again")
        assert ok.done and len(fake.loads) == 1
