"""Durable state in a running daemon: the Ollama learned context map and the learned
footprint priors survive a restart; an unusable state file is a startup error naming it and
its upstream's resources refuse; an unwritable state directory is logged and lending goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import ollama
import pytest
from aiohttp import web

from tests.component.test_ollama_residency import (
    BIG,
    config,
    free_mib,
    refusal,
    status,
)
from tests.support.config import daemon_toml, upstream
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.fake_ollama import FakeOllama
from tests.support.gpu import Gpu, Scenario
from vacancyd.core.events import JobHoldChanged


def gpu(nvml: Scenario) -> None:
    nvml.gpus = [Gpu(total_mib=16_384, used_mib=512)]
    nvml.write()


async def test_learned_contexts_and_priors_survive_a_restart(
    nvml: Scenario, tmp_path: Path
) -> None:
    gpu(nvml)
    state_dir = tmp_path / "state"
    fake = FakeOllama(models=("big:latest",), specs={"big:latest": BIG}, scenario=nvml, tokens=1)
    # The configured footprint (10,000 MiB) is too small: loading takes about 14,300 MiB.
    async with serve_app(fake.app()) as target:
        toml = config(target, state_dir, footprints={"big": 10000})
        async with running_daemon(toml) as d:
            await d.wait_ready()
            async with ollama.AsyncClient(host=d.proxy_url("up")) as borrower:
                await borrower.generate(model="big", prompt="hi")
            await d.wait_until(lambda: bool(d.state.learning.get("up")))
            await d.wait_until(lambda: "big:latest" in d.state.priors.get("up", {}))
            prior = d.state.priors["up"]["big:latest"]
            assert 14_000 <= prior <= 14_400
            doc = await status(d)
            assert doc["upstreams"]["up"]["footprint_priors_mib"] == {"big:latest": prior}
        saved = json.loads((state_dir / "residency" / "up.json").read_text())
        assert saved["version"] == 1 and saved["contexts"][0]["loads"] == 4096
        saved = json.loads((state_dir / "footprints" / "up.json").read_text())
        assert saved["priors"] == {"big:latest": prior}

        # Restarted: the model is still loaded by Ollama; the follow-up is credited at once
        # from the restored map, without a new load through vacancyd.
        async with running_daemon(toml) as d:
            await d.wait_ready()
            assert d.state.priors["up"]["big:latest"] == prior
            async with ollama.AsyncClient(host=d.proxy_url("up")) as borrower:
                ok = await borrower.generate(model="big", prompt="again")
            assert ok.done and len(fake.loads) == 1
            # Once Ollama unloads it, the learned prior, not the configured 10,000 MiB, is
            # what a load is charged: with 12,000 MiB free it is refused.
            async with ollama.AsyncClient(host=d.proxy_url("up")) as borrower:
                await borrower.generate(model="big", prompt="", keep_alive=0)
            await d.wait_until(lambda: free_mib(d) > 15_000)
            nvml.gpus[0].used_mib = 4_384
            nvml.write()
            await d.wait_until(lambda: free_mib(d) < 12_500)
            error = await refusal(d, {"model": "big", "prompt": "x"})
            assert f"{prior} MiB (learned footprint" in error["message"]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('{"version": 1, "upstream": "up", "contexts": [', "corrupt or truncated"),
        ('{"version": 2, "upstream": "up", "contexts": []}', "newer vacancyd"),
        ('{"version": 1, "contexts": [{"digest": 5}]}', "malformed"),
    ],
    ids=["truncated", "newer-version", "malformed"],
)
async def test_an_unusable_state_file_refuses_its_resources_and_is_not_overwritten(
    nvml: Scenario, tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, why: str
) -> None:
    gpu(nvml)
    state_dir = tmp_path / "state"
    path = state_dir / "residency" / "up.json"
    path.parent.mkdir(parents=True)
    path.write_text(content, encoding="utf-8")
    caplog.set_level(logging.ERROR, "vacancyd.runtime.learned")
    fake = FakeOllama(models=("big:latest",), specs={"big:latest": BIG}, scenario=nvml)
    async with serve_app(fake.app()) as target, running_daemon(config(target, state_dir)) as d:
        errors = [r.getMessage() for r in caplog.records]
        assert any(str(path) in e and why in e for e in errors), errors
        await d.wait_until(lambda: d.state.capacity["gpu0"].value is not None)
        error = await refusal(d, {"model": "big", "prompt": "x"})
        assert error["code"] == "resource_unmeasured"
        assert str(path) in error["message"] and why in error["message"]
        doc = await status(d)
        assert doc["resources"]["gpu0"]["state_error"].startswith(str(path))
        d.daemon.saver.mark("residency", "up")
        await d.daemon.saver.flush()
    assert path.read_text(encoding="utf-8") == content


async def test_an_unwritable_state_directory_is_logged_and_lending_goes_on(
    nvml: Scenario, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gpu(nvml)
    # /proc takes no new directories, for root neither: a state directory nobody can create.
    state_dir = Path(f"/proc/vacancyd-state-{os.getpid()}")
    caplog.set_level(logging.ERROR)
    fake = FakeOllama(models=("big:latest",), specs={"big:latest": BIG}, scenario=nvml, tokens=1)
    async with serve_app(fake.app()) as target, running_daemon(config(target, state_dir)) as d:
        await d.wait_ready()
        assert any("is not writable" in r.getMessage() for r in caplog.records)
        async with ollama.AsyncClient(host=d.proxy_url("up")) as borrower:
            await borrower.generate(model="big", prompt="hi")
        await d.wait_until(lambda: bool(d.state.learning.get("up")))
        await d.wait_until(lambda: str(state_dir / "residency" / "up.json") in d.state.write_errors)
        doc = await status(d)
        assert str(state_dir) in doc["durable_state"]["write_errors"]
        assert any("cannot write durable state" in r.getMessage() for r in caplog.records)
        # What was learned still works from memory.
        async with ollama.AsyncClient(host=d.proxy_url("up")) as borrower:
            ok = await borrower.generate(model="big", prompt="again")
        assert ok.done and len(fake.loads) == 1
        assert d.daemon.supervisor.failure is None


def llama_config(target: str, state_dir: Path) -> str:
    return daemon_toml(upstream("llama", target, adapter="llamacpp"), state_dir=state_dir)


def saved_hold(state_dir: Path, release_by: str, **extra: object) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    hold = {
        "job": 7,
        "upstream": "llama",
        "resources": ["ram"],
        "model": "tiny",
        "charged_mib": 100,
        "reason": "cut_uncertain",
        "release_by": release_by,
        "detail": "",
        "held_since": 1_800_000_000.0,
        **extra,
    }
    (state_dir / "holds.json").write_text(json.dumps({"version": 1, "holds": [hold]}))


async def test_a_restored_hold_is_released_by_an_idle_observation_after_the_restart(
    tmp_path: Path,
) -> None:
    state_dir = tmp_path / "state"
    saved_hold(state_dir, "server_idle", borrower="friend")
    busy = {"slots": True}

    async def slots(_: web.Request) -> web.Response:
        return web.json_response([{"id": 0, "is_processing": busy["slots"]}])

    app = web.Application()  # llama-server's /slots, busy until the test says otherwise
    app.router.add_get("/slots", slots)
    async with serve_app(app) as target, running_daemon(llama_config(target, state_dir)) as d:
        (job,) = d.state.ledger.jobs()
        assert job.phase.value == "held" and d.daemon.work.holds.shown()[
            job.id
        ].release_by.value == ("server_idle")
        await asyncio.sleep(0.5)  # busy observations keep it held
        assert d.state.ledger.jobs()
        doc = await status(d)
        assert doc["upstreams"]["llama"]["active_work"][0]["hold"]["reason"] == "cut_uncertain"
        # still its borrower's job: shown, and its row in the ledger names it
        assert doc["upstreams"]["llama"]["active_work"][0]["borrower"] == "friend"
        ends: list[JobHoldChanged] = []
        d.state.subscribe(
            lambda e: ends.append(e) if isinstance(e, JobHoldChanged) and not e.held else None
        )
        busy["slots"] = False
        await d.wait_until(lambda: not d.state.ledger.jobs(), 5)
        await d.wait_until(lambda: bool(ends), 5)
        assert [e.borrower for e in ends] == ["friend"], "the hold's end names its borrower"


async def test_an_unusable_holds_file_refuses_every_resource(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "holds.json").write_text('{"version": 1, "holds": [{"job": 1', encoding="utf-8")
    caplog.set_level(logging.ERROR, "vacancyd.runtime.learned")
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(llama_config(target, state_dir)) as d:
        assert any("holds.json" in r.getMessage() for r in caplog.records)
        await d.wait_until(lambda: d.state.capacity["ram"].value is not None)
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                d.proxy_url("llama") + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
            ) as r,
        ):
            assert r.status == 503
            error = (await r.json())["error"]
        assert error["code"] == "resource_unmeasured" and "holds.json" in error["message"]
    assert '[{"job": 1' in (state_dir / "holds.json").read_text(encoding="utf-8")


async def test_a_change_made_while_its_file_is_being_written_is_written_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change that arrives while the previous version of the same file is still being
    written must be written after it: otherwise the file keeps the older state (a released
    hold would come back at the next start)."""
    import threading

    from vacancyd.runtime import durable

    real_write = durable.write_state
    first_write_started, let_it_finish = threading.Event(), threading.Event()

    def slow_first_write(path: Path, data: dict[str, object]) -> None:
        if not first_write_started.is_set():
            first_write_started.set()
            let_it_finish.wait(10)
        real_write(path, data)

    monkeypatch.setattr(durable, "write_state", slow_first_write)
    state_dir = tmp_path / "state"
    async with serve_app(openai_like_app()[0]) as target:
        async with running_daemon(daemon_toml(upstream("up", target), state_dir=state_dir)) as d:
            await d.wait_ready()
            saved = state_dir / "footprints" / "up.json"
            d.state.priors["up"] = {"old": 1}
            d.daemon.saver.mark("footprints", "up")
            await asyncio.to_thread(first_write_started.wait, 10)
            d.state.priors["up"] = {"new": 2}  # changes while {"old": 1} is being written
            d.daemon.saver.mark("footprints", "up")
            let_it_finish.set()

            async def written() -> bool:
                return saved.exists() and json.loads(saved.read_text())["priors"] == {"new": 2}

            async with asyncio.timeout(10):
                while not await written():  # noqa: ASYNC110 - a file on disk: poll
                    await asyncio.sleep(0.02)


def _sparse(path: Path, size: int) -> None:
    with path.open("wb") as f:
        f.truncate(size)


def _many_holds(path: Path, count: int) -> None:
    hold = {
        "job": 1,
        "upstream": "llama",
        "resources": ["ram"],
        "model": None,
        "charged_mib": None,
        "reason": "cut_uncertain",
        "release_by": "admin",
        "detail": "",
        "held_since": 1.0,
    }
    path.write_text(json.dumps({"version": 1, "holds": [hold] * count}), encoding="utf-8")


@pytest.mark.parametrize(
    ("write", "why"),
    [
        # 108 MB (sparse: the size of the trial's 400,000 holds), refused from its size alone
        (lambda p: _sparse(p, 108 * 1024 * 1024), "over the 1048576 byte limit"),
        (lambda p: _many_holds(p, 1025), "lists 1025 holds, over the limit of 1024"),
    ],
)
async def test_an_oversized_holds_file_is_refused_and_every_resource_refuses(
    tmp_path: Path, write: Any, why: str
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    path = state_dir / "holds.json"
    write(path)
    size = path.stat().st_size
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(llama_config(target, state_dir)) as d:
        assert why in d.state.state_errors["ram"] and str(path) in d.state.state_errors["ram"]
        await d.wait_until(lambda: d.state.capacity["ram"].value is not None)
        async with aiohttp.ClientSession() as s:
            async with s.get(d.api_url + "/healthz") as r:
                assert r.status == 200
            async with s.post(
                d.proxy_url("llama") + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
            ) as r:
                assert r.status == 503
                error = (await r.json())["error"]
        assert error["code"] == "resource_unmeasured" and why in error["message"]
    assert path.stat().st_size == size  # never overwritten: the holds in it protect the owner
