"""The gated proxy against a fake OpenAI-shaped upstream on loopback: forwarding, streaming,
refusals, limits, auth, header rules, redirects,
disconnects and the ledger."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
import yarl
from aiohttp import web

from tests.support import config as cfg
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from vacancyd.core.ledger import Phase

TOKEN = "borrow-token-0123456789"
READ = "read-token-0123456789ab"


def config(
    target: str,
    *,
    adapter: str = "openai",
    trust_loopback: bool = False,
    poll_s: float = 0.2,
    limits: Mapping[str, Any] | None = None,
    upstream_keys: Mapping[str, Any] | None = None,
    footprints: Mapping[str, int] | None = None,
) -> str:
    """A token-guarded lender with small body limits and short deadlines; ``limits`` and
    ``upstream_keys`` are more keys of ``[server.limits]`` and of the upstream ``up``,
    ``footprints`` its models' footprints (every model 1 MiB by default)."""
    return cfg.daemon_toml(
        cfg.upstream(
            "up",
            target,
            adapter=adapter,
            **(upstream_keys or {}),
            models={"default_mib": 1, "footprint_mib": footprints},
        ),
        server={"trust_loopback": trust_loopback},
        tokens=(cfg.token("cluster", TOKEN, "borrow"), cfg.token("prom", READ, "read")),
        limits={
            "max_request_body_mib": 1,
            "max_buffered_body_mib": 2,
            "body_read_timeout_s": 2,
            "body_idle_timeout_s": 0.5,
            "header_read_timeout_s": 1,
            "write_stall_timeout_s": 1,
            **(limits or {}),
        },
        collectors={"poll_s": poll_s},
    )


AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    app, seen = openai_like_app()
    async with serve_app(app) as url:
        yield url, seen


@pytest.fixture
async def lender(upstream: tuple[str, list[dict[str, Any]]]) -> AsyncIterator[RunningDaemon]:
    async with running_daemon(config(upstream[0])) as d:
        await d.wait_ready()
        yield d


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_forwards_json_and_streams_sse(
    lender: RunningDaemon, upstream: tuple[str, list[dict[str, Any]]], http: aiohttp.ClientSession
) -> None:
    url = lender.proxy_url("up") + "/v1/chat/completions"
    async with http.post(url, json={"model": "m", "messages": []}, headers=AUTH) as r:
        assert r.status == 200
        assert (await r.json())["choices"][0]["message"]["content"] == "hi"
    async with http.post(url, json={"model": "m", "stream": True}, headers=AUTH) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        text = await r.text()
    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
    seen = upstream[1]
    assert seen[-1]["headers"]["Host"] == upstream[0].removeprefix("http://")
    assert "Authorization" not in seen[-1]["headers"]
    assert lender.state.ledger.jobs() == []


async def test_lending_off_refuses_with_the_envelope(
    lender: RunningDaemon, http: aiohttp.ClientSession
) -> None:
    lender.state.set_lending(False)
    url = lender.proxy_url("up") + "/v1/chat/completions"
    async with http.post(url, json={"model": "m"}, headers=AUTH) as r:
        assert r.status == 503
        assert r.headers["Retry-After"] == "300"
        body = await r.json()
    err = body["error"]
    assert err["type"] == "no_vacancy" and err["code"] == "lending_disabled"
    assert err["source"] == "vacancyd" and err["param"] is None and err["message"]
    # discovery still passes through while lending is off
    async with http.get(lender.proxy_url("up") + "/v1/models", headers=AUTH) as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"


async def test_refusal_status_429(
    upstream: tuple[str, list[dict[str, Any]]], http: aiohttp.ClientSession
) -> None:
    async with running_daemon(config(upstream[0], upstream_keys={"refusal_status": 429})) as d:
        await d.wait_ready()
        d.state.set_resource_switch("ram", False)
        async with http.post(d.proxy_url("up") + "/v1/completions", json={}, headers=AUTH) as r:
            assert r.status == 429
            assert (await r.json())["error"]["code"] == "resource_disabled"


async def test_auth(lender: RunningDaemon, http: aiohttp.ClientSession) -> None:
    url = lender.proxy_url("up") + "/v1/models"
    async with http.get(url) as r:
        assert r.status == 401 and (await r.json())["error"]["code"] == "missing_token"
        assert "Bearer" in r.headers["WWW-Authenticate"]
    async with http.get(url, headers={"Authorization": "Bearer wrong-token-000000000"}) as r:
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_token"
    async with http.get(url, headers={"Authorization": f"Bearer {READ}"}) as r:
        assert r.status == 403 and (await r.json())["error"]["code"] == "insufficient_scope"
    async with http.get(url, headers=AUTH) as r:
        assert r.status == 200


async def test_management_and_unrecognized_routes(
    lender: RunningDaemon, http: aiohttp.ClientSession
) -> None:
    base = lender.proxy_url("up")
    for path in ("/metrics", "/health?include_slots=1", "/admin", "/v1/models/..%2F..%2Fmetrics"):
        async with http.get(base + path, headers=AUTH) as r:
            body = await r.json()
            assert r.status == 403, path
            assert body["error"]["code"] == "management_denied"
            assert "/v1/models" in body["error"]["borrower_reads"]
    async with http.delete(base + "/v1/models/x", headers=AUTH) as r:
        assert r.status == 501 and (await r.json())["error"]["code"] == "unrecognized_route"
    # a dot-segment path that resolves to a listed route is classified as that route
    async with http.post(
        yarl.URL(base + "/v1/x/../chat/completions", encoded=True),
        json={"model": "m"},
        headers=AUTH,
    ) as r:
        assert r.status == 200


async def test_management_allow_forwards_but_unknown_writes_stay_501(
    upstream: tuple[str, list[dict[str, Any]]], http: aiohttp.ClientSession
) -> None:
    async with running_daemon(
        config(upstream[0], adapter="llamacpp", upstream_keys={"management": "allow"})
    ) as d:
        await d.wait_ready()
        async with http.get(d.proxy_url("up") + "/slots", headers=AUTH) as r:
            assert r.status == 200 and (await r.json())[0]["is_processing"] is False
        async with http.put(d.proxy_url("up") + "/anything", headers=AUTH) as r:
            assert r.status == 501


async def test_body_limits(lender: RunningDaemon, http: aiohttp.ClientSession) -> None:
    url = lender.proxy_url("up") + "/v1/chat/completions"
    big = io.BytesIO(b"x" * (1024 * 1024 + 1))
    async with http.post(url, data=big, headers=AUTH) as r:  # Content-Length known: early
        assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b"y" * 65536

    async with http.post(url, data=chunked(), headers=AUTH) as r:  # no Content-Length
        assert r.status == 413
    async with http.post(
        url, data=b"{not json", headers={**AUTH, "Content-Type": "application/json"}
    ) as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_request_body"
    async with http.post(url, json={"model": 7}, headers=AUTH) as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_model"
    async with http.post(
        lender.proxy_url("up") + "/v1/responses",
        json={"model": "m", "background": True},
        headers=AUTH,
    ) as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == "background_unsupported"
    assert lender.state.ledger.jobs() == []


async def test_body_budget_exhausted_is_a_retryable_refusal(
    lender: RunningDaemon, http: aiohttp.ClientSession
) -> None:
    proxy_budget = 2 * 1024 * 1024
    url = lender.proxy_url("up") + "/v1/chat/completions"
    release = asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "pad": "' + b"x" * (1024 * 1024 - 100)
        await release.wait()
        yield b'"}'

    # two slow chunked bodies that have each sent almost the 1 MiB limit hold it between
    # them (a body holds what it sent, not what it may send): the budget is then full
    async def post() -> aiohttp.ClientResponse:
        return await http.post(url, data=slow_body(), headers=AUTH)

    first = asyncio.create_task(post())
    second = asyncio.create_task(post())
    await asyncio.sleep(0.2)
    async with http.post(url, data=b"{}" * 10, headers=AUTH) as r:
        assert r.status == 503
        assert r.headers["Retry-After"] == "2"
        assert (await r.json())["error"]["code"] == "body_budget_exhausted"
    release.set()
    for fut in (first, second):
        resp = await fut
        assert resp.status in (200, 503)  # the second may meet the first's reservation
        resp.release()
    assert proxy_budget == 2 * 1024 * 1024


async def test_body_idle_timeout_answers_408(lender: RunningDaemon) -> None:
    host, port = lender.daemon.bound["up"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
        + b'{"model":'
    )
    await writer.drain()
    data = await asyncio.wait_for(reader.read(4096), 5)
    assert data.startswith(b"HTTP/1.1 408")
    assert b"body_idle" in data
    writer.close()


async def test_header_read_timeout_closes_slow_clients(lender: RunningDaemon) -> None:
    host, port = lender.daemon.bound["up"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # headers never finish
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
    writer.close()


async def test_connection_cap(upstream: tuple[str, list[dict[str, Any]]]) -> None:
    # the held connections send nothing: the suite's 1 s header deadline would close them
    # (and free their places) if the machine is slow to open the third
    limits = {"max_connections": 2, "header_read_timeout_s": 60}
    async with running_daemon(config(upstream[0], limits=limits)) as d:
        await d.wait_ready()
        host, port = d.daemon.bound["up"].rsplit(":", 1)
        # connections are accepted, and counted, in the order they were opened: no wait
        held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        reader, writer = await asyncio.open_connection(host, int(port))
        data = await asyncio.wait_for(reader.read(), 5)
        assert data.startswith(b"HTTP/1.1 503") and b"connection_limit" in data
        for _, w in [*held, (reader, writer)]:
            w.close()


async def test_upstream_down_is_502(http: aiohttp.ClientSession) -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as url:
        pass  # the port is now closed
    async with running_daemon(config(url)) as d:
        await d.wait_ready()
        async with http.post(
            d.proxy_url("up") + "/v1/chat/completions", json={}, headers=AUTH
        ) as r:
            assert r.status == 502
            body = await r.json()
        assert (
            body["error"]["code"] == "upstream_unreachable"
            and body["error"]["source"] == "vacancyd"
        )
        assert "Traceback" not in json.dumps(body)
        assert d.state.ledger.jobs() == []


async def test_header_rules_and_credentials(http: aiohttp.ClientSession) -> None:
    app, seen = openai_like_app()

    async def echo(request: web.Request) -> web.Response:
        resp = web.json_response({"ok": True})
        resp.headers["Connection"] = "close, X-Drop"
        resp.headers["X-Drop"] = "1"
        resp.headers["Keep-Alive"] = "timeout=5"
        resp.headers["Proxy-Authenticate"] = "Basic"
        resp.headers["X-Keep"] = "1"
        seen.append({"path": request.path, "headers": dict(request.headers)})
        return resp

    app.router.add_get("/v1/models/echo", echo)
    async with (
        serve_app(app) as url,
        running_daemon(config(url, upstream_keys={"credential": "upstream-secret-key"})) as d,
    ):
        await d.wait_ready()
        async with http.get(
            d.proxy_url("up") + "/v1/models/echo",
            headers={
                **AUTH,
                "Connection": "X-Hop",
                "X-Hop": "1",
                "Proxy-Authorization": "Basic abc",
                "Origin": "https://evil.example",
                "X-Forwarded-For": "keep-me",
                "TE": "trailers",
            },
        ) as r:
            assert r.status == 200
            assert r.headers.get("X-Keep") == "1"
            for dropped in ("X-Drop", "Proxy-Authenticate"):
                assert dropped not in r.headers
            # the upstream's own Keep-Alive (hop-by-hop) is dropped; the listener's says
            # how long this connection, the borrower's, stays open
            assert r.headers.getall("Keep-Alive") == ["timeout=75"]
        got = seen[-1]["headers"]
        assert got["Authorization"] == "Bearer upstream-secret-key"
        for dropped in ("X-Hop", "Proxy-Authorization", "Origin", "TE"):
            assert dropped not in got
        # a borrower's own X-Forwarded-For is replaced by its real address (the default
        # forwarded_headers = "replace"; a spoofed one used to pass through unchanged)
        assert got["X-Forwarded-For"] == "127.0.0.1"
        assert got["Host"] == url.removeprefix("http://")


async def test_forward_authorization(http: aiohttp.ClientSession) -> None:
    app, seen = openai_like_app()
    async with (
        serve_app(app) as url,
        running_daemon(config(url, upstream_keys={"forward_authorization": True})) as d,
    ):
        await d.wait_ready()
        async with http.get(d.proxy_url("up") + "/v1/models", headers=AUTH) as r:
            assert r.status == 200
        assert seen[-1]["headers"]["Authorization"] == f"Bearer {TOKEN}"


async def test_redirects_are_returned_and_rewritten(http: aiohttp.ClientSession) -> None:
    app, _ = openai_like_app()
    target: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        where = request.query.get("to", "")
        return web.Response(status=307, headers={"Location": where.replace("SELF", target[0])})

    app.router.add_get("/v1/models/{name}", redirect)
    async with serve_app(app) as url, running_daemon(config(url)) as d:
        target.append(url)
        port = url.rsplit(":", 1)[1]
        await d.wait_ready()
        base = d.proxy_url("up") + "/v1/models/r"
        cases = {
            "SELF/v1/models": "/v1/models",
            f"http://localhost:{port}/v1/models?x=1": "/v1/models?x=1",
            "https://elsewhere.example/a": "https://elsewhere.example/a",
            "/relative": "/relative",
        }
        for location, expected in cases.items():
            async with http.get(
                base, params={"to": location}, headers=AUTH, allow_redirects=False
            ) as r:
                assert r.status == 307
                assert r.headers["Location"] == expected


async def test_proxy_environment_is_ignored(
    upstream: tuple[str, list[dict[str, Any]]],
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "")
    async with running_daemon(config(upstream[0])) as d:
        await d.wait_ready()
        async with http.get(d.proxy_url("up") + "/v1/models", headers=AUTH) as r:
            assert r.status == 200


async def test_ledger_serializes_and_client_disconnect_cancels_upstream(
    http: aiohttp.ClientSession,
) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return resp

    app, _ = openai_like_app(extra={("POST", "/v1/completions"): slow_stream})
    # a slow poll: the only capacity sample after the release is the one asked for
    async with serve_app(app) as url, running_daemon(config(url, poll_s=30)) as d:
        await d.wait_ready()
        base = d.proxy_url("up")
        session = aiohttp.ClientSession()
        resp = await session.post(base + "/v1/completions", json={"model": "m"}, headers=AUTH)
        assert resp.status == 200
        assert await resp.content.readline() == b"data: first\n"
        await asyncio.wait_for(started.wait(), 5)
        (job,) = d.state.ledger.jobs()
        assert job.phase is Phase.FORWARDING and job.model == "m"

        async with http.post(base + "/v1/chat/completions", json={"model": "m"}, headers=AUTH) as r:
            assert r.status == 503
            assert r.headers["Retry-After"] == "2"
            assert (await r.json())["error"]["code"] == "resource_busy"

        resp.close()
        await session.close()
        await asyncio.wait_for(cancelled.wait(), 5)
        await d.wait_until(lambda: not d.state.ledger.jobs(), 5)
        released = d.state.ledger.released_at("ram")
        await asyncio.sleep(0.3)  # let the sample the release asked for land
        sampled = d.state.capacity["ram"].observed_at
        assert released is not None and sampled is not None and sampled > released
        # the next job is admitted on that post-release sample, without waiting a poll
        async with http.post(base + "/v1/chat/completions", json={"model": "m"}, headers=AUTH) as r:
            assert r.status == 200


async def test_upstream_breaking_mid_stream_is_not_a_clean_end(http: aiohttp.ClientSession) -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        assert request.transport is not None
        request.transport.abort()
        return resp

    app, _ = openai_like_app(extra={("POST", "/v1/completions"): broken})
    async with serve_app(app) as url, running_daemon(config(url)) as d:
        await d.wait_ready()
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(d.proxy_url("up") + "/v1/completions", json={}, headers=AUTH) as r:
                assert r.status == 200
                await r.read()
        await d.wait_until(lambda: not d.state.ledger.jobs(), 5)


async def test_stalled_borrower_is_disconnected(http: aiohttp.ClientSession) -> None:
    async def firehose(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"z" * 65536
        try:
            for _ in range(4000):  # 256 MiB: far more than socket buffers hold
                await resp.write(chunk)
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp

    app, _ = openai_like_app(extra={("POST", "/v1/completions"): firehose})
    async with serve_app(app) as url, running_daemon(config(url)) as d:
        await d.wait_ready()
        host, port = d.daemon.bound["up"].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Length: 2\r\n\r\n{}".encode()
        )
        await writer.drain()
        await reader.read(100)  # headers arrive; then we stop reading entirely
        await d.wait_until(lambda: not d.state.ledger.jobs(), 10)
        writer.close()


async def test_a8_stale_server_proof_takes_one_fresh_observation(
    http: aiohttp.ClientSession,
) -> None:
    app, _ = openai_like_app()
    async with (
        serve_app(app) as url,
        running_daemon(
            config(url, adapter="llamacpp", upstream_keys={"resident_min_free_mib": 1})
        ) as d,
    ):
        await d.wait_ready()
        await d.wait_until(lambda: "up" in d.state.servers, 5)
        obs = d.state.servers["up"]
        assert obs.observed_at is not None
        # make the only proof stale: the refusal path must fetch a fresh one and admit
        from dataclasses import replace

        d.state.servers["up"] = replace(obs, observed_at=obs.observed_at - 5)
        async with http.post(
            d.proxy_url("up") + "/v1/chat/completions", json={"model": "m"}, headers=AUTH
        ) as r:
            assert r.status == 200


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
async def test_encoded_request_bodies_are_forwarded_decoded(
    lender: RunningDaemon,
    upstream: tuple[str, list[dict[str, Any]]],
    http: aiohttp.ClientSession,
    encoding: str,
) -> None:
    """aiohttp decodes the body to read the model name; what is forwarded is that decoded
    body, so its Content-Encoding must not travel with it (Ollama's /v1/responses takes zstd)."""
    import gzip

    from backports import zstd

    raw = json.dumps({"model": "m", "messages": []}).encode()
    data = gzip.compress(raw) if encoding == "gzip" else zstd.compress(raw)
    headers = {**AUTH, "Content-Encoding": encoding, "Content-Type": "application/json"}
    url = lender.proxy_url("up") + "/v1/chat/completions"
    async with http.post(url, data=data, headers=headers) as r:
        assert r.status == 200
    got = upstream[1][-1]
    assert got["body"] == {"model": "m", "messages": []}
    assert "Content-Encoding" not in got["headers"]
    async with http.post(url, data=b"\x28\xb5\x2f\xfd broken", headers=headers) as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "invalid_request_body"
    assert lender.state.ledger.jobs() == []


async def test_body_is_read_as_json_whatever_its_content_type(
    upstream: tuple[str, list[dict[str, Any]]], http: aiohttp.ClientSession
) -> None:
    """Inference servers parse the body as JSON whatever Content-Type says, so a borrower
    cannot dodge the footprint check (or the background refusal) by mislabelling it."""
    toml = config(upstream[0], footprints={"big": 100000000})
    async with running_daemon(toml) as d:
        await d.wait_ready()
        url = d.proxy_url("up") + "/v1/chat/completions"
        body = json.dumps({"model": "big", "messages": []}).encode()
        for content_type in (
            "application/json",
            "text/plain",
            "application/x-www-form-urlencoded",
            None,
        ):
            headers = dict(AUTH)
            if content_type:
                headers["Content-Type"] = content_type
            async with http.post(url, data=body, headers=headers) as r:
                assert r.status == 503, content_type
                assert (await r.json())["error"]["code"] == "insufficient_capacity"
        async with http.post(
            d.proxy_url("up") + "/v1/responses",
            data=b'{"model": "m", "background": true}',
            headers={**AUTH, "Content-Type": "text/plain"},
        ) as r:
            assert r.status == 400
        async with http.post(
            url, data=b'{"model":', headers={**AUTH, "Content-Type": "text/plain"}
        ) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_request_body"
        deep = b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        async with http.post(url, data=deep, headers=AUTH) as r:
            assert r.status == 400
            assert "too deeply" in (await r.json())["error"]["message"]
        # multipart (OpenAI's audio routes): the model is a form field
        form = aiohttp.FormData()
        form.add_field("model", "big")
        form.add_field("file", b"RIFF....", filename="a.wav", content_type="audio/wav")
        async with http.post(
            d.proxy_url("up") + "/v1/audio/transcriptions", data=form, headers=AUTH
        ) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "insufficient_capacity"
        assert d.state.ledger.jobs() == []


async def test_non_utf8_bearer_token_is_a_401(lender: RunningDaemon) -> None:
    for listener, path in (("up", "/v1/models"), ("api", "/status")):
        host, port = lender.daemon.bound[listener].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
            + b"Authorization: Bearer \xff\xfe\xe9abc\r\n\r\n"
        )
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert data.startswith(b"HTTP/1.1 401"), data[:80]
        assert b"invalid_token" in data


async def test_upstream_sending_garbage_is_a_502_protocol_error(
    http: aiohttp.ClientSession,
) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_daemon(config(f"http://127.0.0.1:{port}")) as d:
            await d.wait_ready()
            async with http.get(d.proxy_url("up") + "/v1/models", headers=AUTH) as r:
                assert r.status == 502
                err = (await r.json())["error"]
            assert err["code"] == "upstream_protocol_error"
            assert "did not send a valid HTTP response" in err["message"]
    finally:
        server.close()
        await server.wait_closed()


async def test_expect_100_continue_refuses_before_the_upload(lender: RunningDaemon) -> None:
    """A work request the gate would refuse anyway is answered instead of 100 Continue, so
    the borrower never uploads the body; an admissible one gets 100 Continue."""
    host, port = lender.daemon.bound["up"].rsplit(":", 1)
    body = json.dumps({"model": "m", "messages": [], "pad": "x" * 500_000}).encode()

    async def send_headers() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        await writer.drain()
        return reader, writer

    lender.state.set_lending(False)
    reader, writer = await send_headers()
    status_line = await asyncio.wait_for(reader.readline(), 5)
    assert status_line.startswith(b"HTTP/1.1 503"), status_line
    rest = await asyncio.wait_for(reader.read(), 5)
    assert b"lending_disabled" in rest
    writer.close()

    lender.state.set_lending(True)
    reader, writer = await send_headers()
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 100")
    await reader.readline()
    writer.write(body)
    await writer.drain()
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
    writer.close()
    await lender.wait_until(lambda: not lender.state.ledger.jobs(), 5)


async def test_vllm_adapter_end_to_end(
    upstream: tuple[str, list[dict[str, Any]]], http: aiohttp.ClientSession
) -> None:
    """Adding a server kind is one adapter module: vLLM's table behind a real listener."""
    async with running_daemon(config(upstream[0], adapter="vllm")) as d:
        await d.wait_ready()
        base = d.proxy_url("up")
        async with http.post(base + "/v1/chat/completions", json={"model": "m"}, headers=AUTH) as r:
            assert r.status == 200
        async with http.get(base + "/health", headers=AUTH) as r:
            assert r.status == 200
        async with http.get(base + "/load", headers=AUTH) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "management_denied"
        async with http.post(base + "/sleep?level=1", headers=AUTH) as r:
            assert r.status == 403


async def test_absolute_form_request_target(lender: RunningDaemon) -> None:
    """HTTP/1.1 servers must accept ``GET http://host/path``; it is classified by its path."""
    from vacancyd.proxy.app import origin_form

    assert origin_form("http://h:1/v1/models?x=1") == "/v1/models?x=1"
    assert origin_form("http://h:1?x") == "/?x"
    assert origin_form("/v1/%73lots") == "/v1/%73lots"
    host, port = lender.daemon.bound["up"].rsplit(":", 1)
    for target, status in (("/v1/models", b"200"), ("/%73lots", b"403")):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"GET http://lender.example{target} HTTP/1.1\r\nHost: lender.example\r\n".encode()
            + f"Authorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert data.startswith(b"HTTP/1.1 " + status), (target, data[:60])
