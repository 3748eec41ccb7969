"""vacancyd in front of a real Ollama (``tools/build-ollama.sh``) serving the tiny random-weight
model on the CPU, gated on system memory (the ``ram`` resource), with the real ``ollama`` and
``openai`` Python clients as borrowers.

Covered: borrowed chat and generate (native and ``/v1``, streamed and not); refusals in
Ollama's own error shape on the native routes and the OpenAI envelope on ``/v1``; management
routes never reaching the server; the ``keep_alive`` cap read back from the real ``/api/ps``
``expires_at``, and a body spelling ``keep_alive`` or ``model`` otherwise refused; residency
credit from the real ``/api/ps``; reclaim (cancel, drain, finish) with the real unload; a
borrower that disconnects mid-stream; unload before an exclusive image prompt (ComfyUI
fake); ``vacancyd init`` and ``vacancyd measure`` against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import ollama as ollama_client
import openai
import pytest
from aiohttp import web

from tests.component.test_borrowers import ledger_rows
from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, running_daemon, serve_app
from tests.support.fake_comfyui import FakeComfy
from tests.support.lender import owner_returns
from tests.support.ollama import MODEL, OllamaServer, require_ollama, started_ollama
from vacancyd.config import load_config, parse_config

pytestmark = pytest.mark.ollama

#: A footprint no host has: a request is admitted only with a residency credit.
HUGE_MIB = 100_000_000
#: Tokens to ask for when a stream must outlast the test's actions (the tiny model on a
#: contended CPU makes a few hundred a second; Ollama shifts the context to go on).
LONG = 1_000_000


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OllamaServer]:
    require_ollama()
    server = started_ollama(tmp_path_factory.mktemp("ollama"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def real(real_server: OllamaServer) -> AsyncIterator[OllamaServer]:
    """The module's server, with nothing loaded before and after the test."""
    await asyncio.to_thread(real_server.unload_all)
    yield real_server
    await asyncio.to_thread(real_server.unload_all)


def toml(real: OllamaServer, footprint_mib: int = 64, **keys: Any) -> str:
    return daemon_toml(
        upstream(
            "up",
            real.base_url,
            adapter="ollama",
            models={"footprint_mib": {"tiny": footprint_mib}},
            **keys,
        ),
        owner={"release_after_s": 3600},
    )


@contextlib.asynccontextmanager
async def lender(real: OllamaServer, **kw: Any) -> AsyncIterator[RunningDaemon]:
    async with running_daemon(toml(real, **kw)) as d:
        await d.wait_ready()
        await d.wait_until(lambda: "up" in d.state.servers, 10)
        yield d


def client(d: RunningDaemon) -> ollama_client.AsyncClient:
    return ollama_client.AsyncClient(host=d.proxy_url("up"))


def expires_in_s(entry: dict[str, Any]) -> float:
    """Seconds from now until a real ``/api/ps`` entry's ``expires_at``."""
    text = re.sub(r"(\.\d{6})\d+", r"\1", entry["expires_at"])  # Go's nanoseconds
    return datetime.fromisoformat(text).timestamp() - time.time()


async def ps(real: OllamaServer) -> list[dict[str, Any]]:
    return await asyncio.to_thread(real.ps)


async def wait_for(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)


# -- borrowed work through the real clients -----------------------------------------------


async def test_borrowed_chat_and_generate_native_streamed_and_not(real: OllamaServer) -> None:
    async with lender(real) as d, client(d) as c:
        reply = await c.chat(
            model="tiny", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4}
        )
        assert reply.done and reply.message.role == "assistant"
        chunks = [
            chunk
            async for chunk in await c.chat(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                options={"num_predict": 8},
                stream=True,
            )
        ]
        assert len(chunks) > 2 and chunks[-1].done and not chunks[0].done
        generated = await c.generate(model="tiny", prompt="hi", options={"num_predict": 4})
        assert generated.done and generated.done_reason in ("stop", "length")
        pieces = [
            p
            async for p in await c.generate(
                model="tiny", prompt="hi", options={"num_predict": 8}, stream=True
            )
        ]
        assert len(pieces) > 2 and pieces[-1].done
        tags = await c.list()
        assert [m.model for m in tags.models] == [MODEL]
        assert d.state.ledger.jobs() == []


async def test_borrowed_v1_chat_through_the_openai_client(real: OllamaServer) -> None:
    async with lender(real) as d:
        async with openai.AsyncOpenAI(
            base_url=d.proxy_url("up") + "/v1", api_key="unused", max_retries=0
        ) as c:
            models = await c.models.list()
            assert [m.id for m in models.data] == [MODEL]
            reply = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert reply.choices[0].message.role == "assistant"
            stream = await c.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=8,
                stream=True,
            )
            chunks = [chunk async for chunk in stream]
        assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason is not None
        assert d.state.ledger.jobs() == []


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [503, 429])
async def test_refusals_on_native_routes_are_sentences_the_ollama_client_reads(
    real: OllamaServer, status: int
) -> None:
    async with lender(real, refusal_status=status) as d, client(d) as c:
        d.state.set_lending(False)
        with pytest.raises(ollama_client.ResponseError) as info:
            await c.chat(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == status
        assert isinstance(info.value.error, str)
        assert info.value.error.startswith("No vacancy: "), info.value.error
        assert "lending" in str(info.value)
        with pytest.raises(ollama_client.ResponseError) as streamed:
            async for _ in await c.generate(model="tiny", prompt="hi", stream=True):
                pass
        assert streamed.value.status_code == status
        assert streamed.value.error.startswith("No vacancy: ")
        async with aiohttp.ClientSession() as http:
            async with http.post(d.proxy_url("up") + "/api/generate", json={"model": "tiny"}) as r:
                body = await r.json()
                assert r.status == status and r.headers["Retry-After"] == str(body["retry_after_s"])
                assert body["code"] == "lending_disabled" and body["source"] == "vacancyd"
            # the OpenAI-compatible routes keep the OpenAI envelope
            async with http.post(
                d.proxy_url("up") + "/v1/chat/completions", json={"model": "tiny"}
            ) as r:
                envelope = await r.json()
                assert r.status == status and envelope["error"]["code"] == "lending_disabled"
    assert await ps(real) == []


async def test_management_routes_from_a_borrower_never_reach_the_server(
    real: OllamaServer,
) -> None:
    before = await asyncio.to_thread(real.request, "GET", "/api/tags")
    log_size = real.log_path.stat().st_size
    async with lender(real) as d, client(d) as c:
        calls = [
            c.pull("tiny"),
            c.push("tiny"),
            c.create(model="copy", from_="tiny"),
            c.copy("tiny", "stolen"),
            c.delete("tiny"),
            c.ps(),
        ]
        for call in calls:
            with pytest.raises(ollama_client.ResponseError) as info:
                await call
            assert info.value.status_code == 403
            assert "not a borrower route" in info.value.error
    after = await asyncio.to_thread(real.request, "GET", "/api/tags")
    assert after == before
    with real.log_path.open("rb") as f:
        f.seek(log_size)
        logged = f.read().decode(errors="replace")
    for path in ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete"):
        assert path not in logged


# -- the keep-alive cap ------------------------------------------------------------------


@pytest.mark.parametrize("asked", [-1, "-1m", "24h", 86_400, "2562047h"])
async def test_a_borrower_cannot_pin_a_model_in_the_owners_memory(
    real: OllamaServer, asked: object
) -> None:
    async with lender(real, keep_alive_max_s=60) as d, aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "hi", "stream": False, "keep_alive": asked}
        body["options"] = {"num_predict": 2}
        async with http.post(d.proxy_url("up") + "/api/generate", json=body) as r:
            assert r.status == 200, await r.text()
    (entry,) = await ps(real)
    assert 0 < expires_in_s(entry) <= 61, entry["expires_at"]


async def test_a_shorter_keep_alive_and_none_at_all(real: OllamaServer) -> None:
    async with lender(real, keep_alive_max_s=60) as d, client(d) as c:
        await c.generate(model="tiny", prompt="hi", keep_alive="20s", options={"num_predict": 2})
        (entry,) = await ps(real)
        assert 0 < expires_in_s(entry) <= 21
        hello = [{"role": "user", "content": "hi"}]
        await c.chat(model="tiny", messages=hello, options={"num_predict": 2})
        (entry,) = await ps(real)  # none given: the cap, not the server's 5 minutes
        assert 21 < expires_in_s(entry) <= 61


async def test_a_key_spelled_otherwise_is_refused_since_the_real_server_reads_it(
    real: OllamaServer,
) -> None:
    # Go's decoder reads "Keep_Alive" as keep_alive, the last one given winning: sent to the
    # server directly, this body keeps the model for ever despite its own "1s"
    body = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    body |= {"keep_alive": "1s", "Keep_Alive": -1}
    status, reply = await asyncio.to_thread(real.request, "POST", "/api/generate", body)
    assert status == 200, reply
    (entry,) = await ps(real)
    assert expires_in_s(entry) > 86_400, entry["expires_at"]
    await asyncio.to_thread(real.unload_all)
    async with lender(real, keep_alive_max_s=60) as d, aiohttp.ClientSession() as http:
        async with http.post(d.proxy_url("up") + "/api/generate", json=body) as r:
            assert r.status == 400, await r.text()
            assert "spelled exactly" in (await r.json())["error"]
        smuggled = {"model": "tiny", "MODEL": "other", "prompt": "hi", "stream": False}
        async with http.post(d.proxy_url("up") + "/api/generate", json=smuggled) as r:
            assert r.status == 400, await r.text()
    assert await ps(real) == []


# -- residency credit from the real /api/ps ----------------------------------------------


async def owner_loads(real: OllamaServer, num_ctx: int, keep_alive: str = "10m") -> None:
    body = {"model": "tiny", "options": {"num_ctx": num_ctx}, "keep_alive": keep_alive}
    status, reply = await asyncio.to_thread(real.request, "POST", "/api/generate", body)
    assert status == 200, reply


async def borrowed(d: RunningDaemon, num_ctx: int) -> tuple[int, dict[str, Any]]:
    body = {"model": "tiny", "prompt": "hi", "stream": False}
    body["options"] = {"num_ctx": num_ctx, "num_predict": 2}
    async with aiohttp.ClientSession() as http:
        async with http.post(d.proxy_url("up") + "/api/generate", json=body) as r:
            return r.status, await r.json()


async def test_residency_credit_from_the_real_api_ps(real: OllamaServer) -> None:
    async with lender(real, footprint_mib=HUGE_MIB) as d:
        status, refused = await borrowed(d, 256)
        assert status == 503 and refused["code"] == "insufficient_capacity"

        await owner_loads(real, 256)
        await d.wait_until(lambda: MODEL in _resident(d), 10)  # vacancyd's next /api/ps poll
        (entry,) = await ps(real)
        assert entry["context_length"] == 256 and entry["size_vram"] == 0
        status, reply = await borrowed(d, 256)  # fits only with the credit
        assert status == 200, reply
        status, refused = await borrowed(d, 128)  # a reload with another context
        assert status == 503 and refused["code"] == "insufficient_capacity"
        assert refused["residency_credit"]["applied"] is False

        await asyncio.to_thread(real.unload_all)
        await d.wait_until(lambda: not _resident(d), 10)
        status, refused = await borrowed(d, 256)
        assert status == 503 and refused["code"] == "insufficient_capacity"

        # loaded with a short keep-alive by the owner: once Ollama lets it expire, no credit
        await owner_loads(real, 256, keep_alive="1s")
        await wait_for(lambda: _empty(real), 10, "the model expired")
        status, refused = await borrowed(d, 256)
        assert status == 503 and refused["code"] == "insufficient_capacity"


def _resident(d: RunningDaemon) -> frozenset[str]:
    """What vacancyd's newest observation of the upstream saw loaded."""
    seen = d.state.servers["up"].value
    return frozenset() if seen is None else frozenset(seen.resident_models or ())


async def _empty(real: OllamaServer) -> bool:
    return await ps(real) == []


# -- reclaim ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_stream(
    http: aiohttp.ClientSession, d: RunningDaemon, num_predict: int = LONG
) -> AsyncIterator[aiohttp.ClientResponse]:
    """A borrowed NDJSON stream, its first line read; closed when the block ends."""
    body = {"model": "tiny", "prompt": "hi", "options": {"num_predict": num_predict}}
    async with http.post(d.proxy_url("up") + "/api/generate", json=body) as resp:
        assert resp.status == 200
        first = json.loads(await resp.content.readline())
        assert first["done"] is False
        yield resp


async def test_reclaim_cuts_the_stream_and_the_real_server_unloads(
    real: OllamaServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "vacancyd.control.upstreamcalls")
    async with (
        lender(real, on_owner_return="cancel", yield_on_veto=True) as d,
        aiohttp.ClientSession() as http,
        open_stream(http, d) as resp,
    ):
        assert [m["name"] for m in await ps(real)] == [MODEL]
        owner_returns(d)
        with pytest.raises(aiohttp.ClientPayloadError):
            while True:
                line = await resp.content.readline()
                if not line:
                    break
                assert json.loads(line)["done"] is False  # never a clean end
        await wait_for(lambda: _empty(real), 10, "/api/ps empty after the cut")
        await d.wait_until(lambda: "unloaded up in" in caplog.text, 10)
        # the unload was confirmed on the real /api/ps, not given up on after its 3 s
        assert "still resident" not in caplog.text
        assert d.state.ledger.jobs() == []


async def test_drain_lets_the_stream_end_then_unloads(real: OllamaServer) -> None:
    async with (
        lender(real, on_owner_return="drain", drain_timeout_s=60, yield_on_veto=True) as d,
        aiohttp.ClientSession() as http,
        open_stream(http, d, num_predict=200) as resp,
    ):
        owner_returns(d)
        async with http.post(d.proxy_url("up") + "/api/chat", json={"model": "tiny"}) as r:
            assert r.status == 503 and (await r.json())["code"] == "owner_active"
        lines = [json.loads(line) async for line in resp.content if line.strip()]
        assert lines[-1]["done"] is True  # ran to its end within the drain
        await wait_for(lambda: _empty(real), 10, "/api/ps empty after the drain")


async def test_finish_lets_the_stream_end_then_unloads(real: OllamaServer) -> None:
    async with (
        lender(real, on_owner_return="finish", yield_on_veto=True) as d,
        aiohttp.ClientSession() as http,
        open_stream(http, d, num_predict=200) as resp,
    ):
        owner_returns(d)
        lines = [json.loads(line) async for line in resp.content if line.strip()]
        assert lines[-1]["done"] is True
        await wait_for(lambda: _empty(real), 10, "/api/ps empty after the work finished")


# -- a borrower that disconnects -----------------------------------------------------------


async def test_a_borrower_disconnect_stops_ollama_and_frees_the_job_at_once(
    real: OllamaServer,
) -> None:
    """Ollama stops generating when the request's connection closes (docs/footprints.md),
    so the job's resource is free at once; the runner's CPU time shows it stopped."""
    async with lender(real) as d, aiohttp.ClientSession() as http:
        async with open_stream(http, d) as resp:
            for _ in range(20):
                await resp.content.readline()
            busy_from = real.runner_cpu_s()
            await asyncio.sleep(1.0)
            busy = real.runner_cpu_s() - busy_from
            resp.close()  # the borrower goes away mid-stream
        await d.wait_until(lambda: d.state.ledger.jobs() == [], 2)
        await asyncio.sleep(0.2)  # the runner hears of the cancellation
        idle_from = real.runner_cpu_s()
        await asyncio.sleep(1.0)
        idle = real.runner_cpu_s() - idle_from
    assert busy > 0.2, f"the runner was not generating ({busy:.2f} s CPU in 1 s)"
    assert idle < busy / 5, f"the runner went on after the disconnect ({idle:.2f} s CPU in 1 s)"
    assert [m["name"] for m in await ps(real)] == [MODEL]  # still loaded, idle


# -- exclusivity with an image server --------------------------------------------------------


async def test_the_real_model_is_unloaded_before_an_exclusive_image_prompt(
    real: OllamaServer,
) -> None:
    comfy = FakeComfy(steps=2, step_s=0.05)
    seen_at_prompt: list[list[str]] = []
    app = comfy.app()

    async def prepared(request: web.Request, _: web.StreamResponse) -> None:
        if request.path == "/prompt" and request.method == "POST":
            seen_at_prompt.append([m["name"] for m in await ps(real)])

    app.on_response_prepare.append(prepared)
    async with serve_app(app) as comfy_url:
        config = daemon_toml(
            upstream(
                "up",
                real.base_url,
                adapter="ollama",
                models={"footprint_mib": {"tiny": 64}},
            ),
            upstream("comfy", comfy_url, adapter="comfyui", exclusive_of=["up"]),
        )
        async with running_daemon(config) as d, aiohttp.ClientSession() as http:
            await d.wait_ready()
            async with client(d) as c:
                await c.generate(model="tiny", prompt="hi", options={"num_predict": 2})
            assert [m["name"] for m in await ps(real)] == [MODEL]
            prompt = {"prompt": {"3": {"class_type": "KSampler", "inputs": {}}}}
            async with http.post(d.proxy_url("comfy") + "/prompt", json=prompt) as r:
                assert r.status == 200, await r.text()
    assert seen_at_prompt == [[]]


# -- init and measure ------------------------------------------------------------------------


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vacancyd",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_init_finds_the_real_ollama_and_measure_output_replaces_its_table(
    real: OllamaServer, tmp_path: Path
) -> None:
    address = real.base_url.removeprefix("http://")
    path = tmp_path / "vacancyd.toml"
    code, _, err = await cli("init", f"--server={address}", f"--config={path}", "--no-gpus")
    assert code == 0, err
    assert f"found ollama at {address} (1 model(s))" in err
    (up,) = load_config(path).upstream
    assert up.adapter == "ollama" and str(up.target) == real.base_url + "/"
    assert up.resource != "" and list(up.models.footprint_mib) == [MODEL]

    config = path.read_text()
    async with lender(real) as d:  # measure asks a running daemon whether it may measure
        await d.wait_ready()
        out = tmp_path / "footprints.toml"
        code, _, err = await cli(
            "measure", "--config", str(path), "--url", d.api_url, "--output", str(out)
        )
    assert code == 0, err
    measured = out.read_text()
    assert await ps(real) == []  # measure leaves nothing loaded
    (size,) = re.findall(r"measured (\d+) MiB", measured)
    assert 1 <= int(size) < 64  # the tiny model's size, from /api/ps on a memory resource
    header = "\n[upstream.models.footprint_mib]\n"  # the table, not a comment naming it
    table = measured[measured.index(header) + 1 :]
    start = config.index(header) + 1
    end = config.find("\n\n", start)
    replaced = config[:start] + table + (config[end:] if end != -1 else "")
    (up,) = parse_config(replaced, "<init + measure>").upstream
    assert up.models.footprint_mib[MODEL] in (int(size) + 500, int(size) + 501)  # rounded up


async def test_measure_interrupted_leaves_nothing_loaded(
    real: OllamaServer, tmp_path: Path
) -> None:
    async with lender(real) as d:
        path = tmp_path / "vacancyd.toml"
        path.write_text(toml(real))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "vacancyd",
            "measure",
            "--config",
            str(path),
            "--url",
            d.api_url,
            "--output",
            str(tmp_path / "out.toml"),
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stderr is not None
        while b"loading" not in (line := await proc.stderr.readline()):
            assert line, "measure ended before loading"
        proc.send_signal(signal.SIGINT)
        err = (await asyncio.wait_for(proc.stderr.read(), 60)).decode()
        assert await proc.wait() == 130, err
    assert not (tmp_path / "out.toml").exists()
    await wait_for(lambda: _empty(real), 10, "/api/ps empty after Ctrl-C")


async def test_the_ledger_records_the_counts_the_real_server_reported(real: OllamaServer) -> None:
    """Issue 23: one usage-ledger row per job, with the ``prompt_eval_count`` and
    ``eval_count`` the real Ollama reported (streamed and not)."""
    async with lender(real) as d, client(d) as c:
        reply = await c.chat(
            model="tiny", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4}
        )
        chunks = [
            chunk
            async for chunk in await c.chat(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                options={"num_predict": 6},
                stream=True,
            )
        ]
        rows = await ledger_rows(d, 2)
    last = chunks[-1]
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        (reply.prompt_eval_count, reply.eval_count),
        (last.prompt_eval_count, last.eval_count),
    ]
    assert rows[0]["completion_tokens"] and rows[0]["borrower"] == ""
