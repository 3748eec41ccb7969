"""OpenTelemetry traces from a real daemon, collected with the SDK's in-memory exporter:
one server span per proxied request with the gate's decision, the borrower's trace
continued and propagated upstream, and the post-release sample and reclaim spans."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.config import daemon_toml, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, serve_app, temporary_state_dir
from vacancyd.config import parse_config
from vacancyd.runtime.daemon import Daemon

sdk_export = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")

BORROWER_TRACE = "0af7651916cd43dd8448eb211c80319c"
BORROWER_SPAN = "b7ad6b7169203331"


def toml(target: str, state_dir: Path) -> str:
    return daemon_toml(upstream("up", target, on_owner_return="cancel"), state_dir=state_dir)


@asynccontextmanager
async def traced() -> AsyncIterator[tuple[RunningDaemon, Any, list[dict[str, object]]]]:
    exporter = sdk_export.InMemorySpanExporter()
    app, seen = openai_like_app()
    with temporary_state_dir() as state_dir:
        async with serve_app(app) as url:
            daemon = Daemon(parse_config(toml(url, state_dir), "<test>"), span_exporter=exporter)
            try:
                await daemon.start()
                d = RunningDaemon(daemon)
                await d.wait_ready()
                yield d, exporter, seen
            finally:
                await daemon.shutdown()


def spans(exporter: Any, name: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def until(predicate: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls spans another task finishes
            await asyncio.sleep(0.02)


async def test_admitted_request_span_continues_the_borrowers_trace_upstream() -> None:
    async with traced() as (d, exporter, seen), aiohttp.ClientSession() as http:
        traceparent = f"00-{BORROWER_TRACE}-{BORROWER_SPAN}-01"
        async with http.post(
            f"{d.proxy_url('up')}/v1/chat/completions",
            json={"model": "tiny", "messages": []},
            headers={"traceparent": traceparent},
        ) as resp:
            assert resp.status == 200
        await until(lambda: spans(exporter, "vacancyd.post_release_sample"))
        (request,) = spans(exporter, "vacancyd.request")
        ctx = request.context
        assert f"{ctx.trace_id:032x}" == BORROWER_TRACE
        assert request.parent is not None and f"{request.parent.span_id:016x}" == BORROWER_SPAN
        attrs = dict(request.attributes)
        assert attrs["vacancyd.decision"] == "admitted"
        assert attrs["vacancyd.upstream"] == "up" and attrs["vacancyd.route_class"] == "work"
        assert attrs["http.response.status_code"] == 200
        assert tuple(attrs["vacancyd.resources"]) == ("ram",)
        assert attrs["vacancyd.borrower"] == "default"  # trusted loopback, no borrower's token
        # the upstream got our span as its parent, in the borrower's trace
        sent = seen[-1]["headers"]
        assert isinstance(sent, dict)
        assert sent["traceparent"] == f"00-{BORROWER_TRACE}-{ctx.span_id:016x}-01"
        (sample,) = spans(exporter, "vacancyd.post_release_sample")
        assert sample.parent is not None and sample.parent.span_id == ctx.span_id
        assert sample.attributes["vacancyd.sampled"] is True
        resource = dict(request.resource.attributes)
        assert resource["service.name"] == "vacancyd"


async def test_refusal_span_carries_the_reason() -> None:
    async with traced() as (d, exporter, seen), aiohttp.ClientSession() as http:
        d.state.set_lending(False)
        async with http.post(
            f"{d.proxy_url('up')}/v1/chat/completions", json={"model": "tiny", "messages": []}
        ) as resp:
            assert resp.status == 503
        (request,) = spans(exporter, "vacancyd.request")
        attrs = dict(request.attributes)
        assert attrs["vacancyd.decision"] == "refused"
        assert attrs["vacancyd.reason"] == "lending_disabled"
        assert attrs["http.response.status_code"] == 503
        assert request.parent is None  # no borrower trace: a new root
        assert seen == [] and not spans(exporter, "vacancyd.post_release_sample")


async def test_reclaim_is_its_own_span() -> None:
    async with traced() as (d, exporter, _), aiohttp.ClientSession() as http:
        async with http.post(f"{d.api_url}/admin/reclaim", json={}) as resp:
            assert resp.status < 300
        await until(lambda: spans(exporter, "vacancyd.reclaim"))
        (reclaim,) = spans(exporter, "vacancyd.reclaim")
        attrs = dict(reclaim.attributes)
        assert attrs["vacancyd.upstream"] == "up"
        assert attrs["vacancyd.reclaim.trigger"] == "admin"
        assert attrs["vacancyd.reclaim.policy"] == "cancel"
        assert attrs["vacancyd.reclaim.outcome"]
        assert reclaim.events[0].name in ("waiting", "proceeding")


def test_tracing_is_off_by_default(tmp_path: Path) -> None:
    settings = parse_config(toml("http://127.0.0.1:1", tmp_path), "<test>")
    assert settings.telemetry.otlp_endpoint is None
    from vacancyd.runtime.telemetry import start_tracing, traces_url

    assert start_tracing(settings.telemetry, Daemon(settings).state) is None
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("http://c:4318/custom/path") == "http://c:4318/custom/path"
