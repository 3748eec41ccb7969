"""The Ollama look-alike (tests/support/fake_ollama.py) held to the real Ollama.

Each test sends the same requests to the fake and to a real ``ollama serve``
(``tools/build-ollama.sh``, the tiny model registered as ``tiny:latest``) and asserts the
same status codes, the same content types and stream framing, and that every key the fake
sends is one the real server sends at the same place with the same JSON type. Where
vacancyd parses a reply (``/api/ps`` entries, errors), the key sets must be equal.

What the fake still models alone, because the real server cannot show it here: VRAM figures
on a GPU (``size_vram`` below ``size`` for a spill), and load times of large models.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aiohttp
import pytest

from tests.support.daemon import serve_app
from tests.support.fake_ollama import FakeOllama, ModelSpec
from tests.support.ollama import CONTEXT_TOKENS, MODEL, OllamaServer, require_ollama, started_ollama

pytestmark = pytest.mark.ollama


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OllamaServer]:
    require_ollama()
    server = started_ollama(tmp_path_factory.mktemp("ollama"))
    try:
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class Servers:
    real: str
    fake: str


@pytest.fixture
async def servers(real_server: OllamaServer) -> AsyncIterator[Servers]:
    await asyncio.to_thread(real_server.unload_all)
    fake = FakeOllama(models=(MODEL,), specs={MODEL: ModelSpec(train_ctx=CONTEXT_TOKENS)})
    async with serve_app(fake.app()) as fake_url:
        yield Servers(real_server.base_url, fake_url)
    await asyncio.to_thread(real_server.unload_all)


@dataclass
class Reply:
    status: int
    content_type: str
    body: Any
    """The decoded JSON, the list of NDJSON objects, or the list of SSE ``data:`` payloads
    (``[DONE]`` kept as the string) — according to the content type."""


async def send(
    http: aiohttp.ClientSession, base: str, method: str, path: str, body: Any = None
) -> Reply:
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
    async with http.request(method, base + path, data=data) as r:
        raw = await r.read()
        ctype = r.headers.get("Content-Type", "").split(";")[0].strip()
    if ctype == "application/x-ndjson":
        lines = raw.decode().split("\n")
        assert lines[-1] == "", "an NDJSON stream ends with a newline"
        return Reply(r.status, ctype, [json.loads(line) for line in lines[:-1]])
    if ctype == "text/event-stream":
        events = [e for e in raw.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events), events
        payloads = [e.removeprefix("data: ") for e in events]
        return Reply(r.status, ctype, [p if p == "[DONE]" else json.loads(p) for p in payloads])
    try:
        return Reply(r.status, ctype, json.loads(raw) if raw else None)
    except ValueError:
        return Reply(r.status, ctype, raw.decode(errors="replace"))


def kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def differences(fake: Any, real: Any, where: str = "$", exact: bool = False) -> list[str]:
    """Where ``fake`` says something ``real`` does not: a key the real reply lacks, or another
    JSON type. ``exact``: the real reply's keys must all be in the fake's too."""
    if kind(fake) != kind(real):
        return [f"{where}: fake {kind(fake)} {fake!r:.80}, real {kind(real)} {real!r:.80}"]
    found: list[str] = []
    if isinstance(fake, dict):
        for key, value in fake.items():
            if key not in real:
                found.append(f"{where}.{key}: only the fake sends it")
            else:
                found += differences(value, real[key], f"{where}.{key}", exact)
        if exact:
            found += [f"{where}.{k}: only the real server sends it" for k in real if k not in fake]
    elif isinstance(fake, list) and fake and real:
        found += differences(fake[0], real[0], f"{where}[0]", exact)
    return found


async def both(
    servers: Servers, method: str, path: str, body: Any = None, exact: bool = False
) -> tuple[Reply, Reply]:
    """Send to both; assert the same status, content type and shape; return (fake, real)."""
    async with aiohttp.ClientSession() as http:
        real = await send(http, servers.real, method, path, body)
        fake = await send(http, servers.fake, method, path, body)
    what = f"{method} {path} {body!r:.60}"
    assert fake.status == real.status, f"{what}: fake {fake.status}, real {real.status} {real.body}"
    assert fake.content_type == real.content_type, what
    assert differences(fake.body, real.body, exact=exact) == [], what
    return fake, real


def ps_models(reply: Reply) -> list[dict[str, Any]]:
    assert reply.status == 200
    return list(reply.body["models"] or [])


async def test_discovery_routes(servers: Servers) -> None:
    fake, real = await both(servers, "GET", "/api/version", exact=True)
    assert isinstance(real.body["version"], str)
    fake, real = await both(servers, "GET", "/api/tags")
    assert [m["name"] for m in fake.body["models"]] == [m["name"] for m in real.body["models"]]
    fake, real = await both(servers, "POST", "/api/show", {"model": "tiny"})
    assert "parameters" not in real.body or isinstance(real.body["parameters"], str)
    await both(servers, "GET", "/v1/models", exact=True)
    async with aiohttp.ClientSession() as http:
        for base in (servers.real, servers.fake):
            async with http.get(base + "/") as r:
                assert (r.status, await r.text()) == (200, "Ollama is running")
            async with http.head(base + "/") as r:
                assert r.status == 200


async def test_ps_before_during_and_after_a_load(servers: Servers) -> None:
    fake, real = await both(servers, "GET", "/api/ps", exact=True)
    assert ps_models(fake) == ps_models(real) == []
    body = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    await both(servers, "POST", "/api/generate", body)
    fake, real = await both(servers, "GET", "/api/ps", exact=True)
    (f,), (r,) = ps_models(fake), ps_models(real)
    assert f["name"] == r["name"] == MODEL
    # with a keep_alive: both list an expiry that far away
    await both(servers, "POST", "/api/generate", {**body, "keep_alive": "1m"})
    await both(servers, "GET", "/api/ps", exact=True)


async def test_generate_and_chat_streamed_and_not(servers: Servers) -> None:
    options = {"num_predict": 4}
    for path, body in (
        ("/api/generate", {"model": "tiny", "prompt": "hi", "options": options}),
        (
            "/api/chat",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": options},
        ),
    ):
        fake, real = await both(servers, "POST", path, {**body, "stream": False})
        assert fake.body["done"] is real.body["done"] is True
        fake, real = await both(servers, "POST", path, body)  # stream absent: streamed
        for reply in (fake, real):
            assert reply.content_type == "application/x-ndjson"
            assert [line["done"] for line in reply.body[:-1]] == [False] * (len(reply.body) - 1)
            assert reply.body[-1]["done"] is True and "done_reason" in reply.body[-1]
        assert differences(fake.body[-1], real.body[-1]) == []


async def test_keep_alive_zero_unloads(servers: Servers) -> None:
    body = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    await both(servers, "POST", "/api/generate", body)
    fake, real = await both(servers, "POST", "/api/generate", {"model": "tiny", "keep_alive": 0})
    assert fake.body["done_reason"] == real.body["done_reason"] == "unload"
    for _ in range(100):
        fake, real = await both(servers, "GET", "/api/ps")
        if ps_models(real) == []:
            break
        await asyncio.sleep(0.05)
    assert ps_models(fake) == ps_models(real) == []


async def test_openai_routes(servers: Servers) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    fake, real = await both(servers, "POST", "/v1/chat/completions", body)
    assert fake.body["object"] == real.body["object"] == "chat.completion"
    fake, real = await both(servers, "POST", "/v1/chat/completions", {**body, "stream": True})
    for reply in (fake, real):
        assert reply.content_type == "text/event-stream" and reply.body[-1] == "[DONE]"
        assert reply.body[0]["object"] == "chat.completion.chunk"


async def test_errors(servers: Servers) -> None:
    _, real = await both(servers, "POST", "/api/generate", {"model": "nope", "prompt": "x"})
    assert real.status == 404 and isinstance(real.body["error"], str)
    await both(servers, "POST", "/api/chat", {"model": "nope", "messages": []}, exact=True)
    await both(servers, "POST", "/api/show", {"model": "nope"}, exact=True)
    hello = [{"role": "user", "content": "x"}]
    await both(servers, "POST", "/v1/chat/completions", {"model": "nope", "messages": hello})
    await both(servers, "POST", "/v1/chat/completions", b"{not json", exact=True)
    await both(servers, "POST", "/api/generate", {"prompt": "x"}, exact=True)  # no model
    _, real = await both(servers, "POST", "/api/generate", b"{not json", exact=True)
    assert real.status == 400
    await both(servers, "POST", "/api/chat", b"[1, 2]", exact=True)
    await both(
        servers, "POST", "/api/generate", {"model": "tiny", "keep_alive": "soon"}, exact=True
    )
    await both(servers, "GET", "/api/nothing-here")


def expires_in_s(entry: dict[str, Any]) -> float:
    """Seconds from now until an ``/api/ps`` entry's ``expires_at`` (Go's RFC 3339 form)."""
    text = re.sub(r"(\.\d{6})\d+", r"\1", entry["expires_at"])
    return datetime.fromisoformat(text).timestamp() - time.time()


async def test_ps_while_a_request_runs(servers: Servers) -> None:
    """Busy, a model lists the expiry it had when it last went idle, or while it is still in
    its first load, now + its keep-alive; the fake and the real server agree on which."""
    body = {"model": "tiny", "prompt": "hi", "options": {"num_predict": 1_000_000}}
    async with aiohttp.ClientSession() as http:
        expiries: dict[str, list[float]] = {}
        for name, base in (("real", servers.real), ("fake", servers.fake)):
            first = {**body, "stream": False, "keep_alive": "1m", "options": {"num_predict": 1}}
            async with http.post(base + "/api/generate", json=first) as r:
                assert r.status == 200
            await asyncio.sleep(1.5)  # idle for a while: the expiry is now - 1.5 s + 60 s
            async with http.post(base + "/api/generate", json={**body, "keep_alive": "10m"}) as r:
                await r.content.readline()
                reply = await send(http, base, "GET", "/api/ps")
                (entry,) = reply.body["models"]
                expiries[name] = [expires_in_s(entry)]
        for name, (left,) in expiries.items():
            assert 50 < left < 59.5, f"{name}: a busy model lists {left:.1f} s to its expiry"
