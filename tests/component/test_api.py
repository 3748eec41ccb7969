"""API listener: health, readiness, status, metrics,
admin switches and their scopes, and the ``vacancyd status`` CLI against a live daemon."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.config import daemon_toml, resource, token, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from vacancyd.api.app import make_api
from vacancyd.cli import format_status, main
from vacancyd.config import parse_config
from vacancyd.core.status import StatusDocument
from vacancyd.runtime.daemon import Daemon
from vacancyd.web.auth import Authenticator

ADMIN = "admin-token-0123456789ab"
READ = "read-token-0123456789abc"
BORROW = "borrow-token-0123456789"


def config(target: str, presence: str | None = "headless") -> str:
    """A token-guarded lender (admin, read and borrow tokens) gated on memory and CPU;
    ``presence=None`` leaves presence unconfigured."""
    return daemon_toml(
        upstream("llm", target, also_requires=["cpu"]),
        resources=(resource("ram"), resource("cpu", "cpu")),
        server={"trust_loopback": None},
        tokens=(
            token("ops", ADMIN, "admin"),
            token("prom", READ, "read"),
            token("cluster", BORROW, "borrow"),
        ),
        owner={"presence": presence},
        collectors={"poll_s": 0.2},
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def lender() -> AsyncIterator[RunningDaemon]:
    app, _ = openai_like_app()
    async with serve_app(app) as url, running_daemon(config(url)) as d:
        yield d


async def test_health_ready_and_scopes(lender: RunningDaemon) -> None:
    api = lender.api_url
    async with aiohttp.ClientSession() as http:
        async with http.get(api + "/healthz") as r:
            assert r.status == 200
        await lender.wait_ready()
        async with http.get(api + "/readyz") as r:
            assert r.status == 200 and await r.json() == {"status": "ready"}
        for path in ("/status", "/metrics"):
            async with http.get(api + path) as r:
                assert r.status == 401
            async with http.get(api + path, headers=bearer(BORROW)) as r:
                assert r.status == 403
            async with http.get(api + path, headers=bearer(READ)) as r:
                assert r.status == 200
            async with http.get(api + path, headers=bearer(ADMIN)) as r:
                assert r.status == 200  # admin implies read
        async with http.put(
            api + "/admin/lending", json={"enabled": False}, headers=bearer(READ)
        ) as r:
            assert r.status == 403
        assert lender.state.lending_enabled


async def test_readyz_waits_for_presence_and_is_detail_free() -> None:
    app, _ = openai_like_app()
    async with serve_app(app) as url, running_daemon(config(url, presence=None)) as d:
        async with aiohttp.ClientSession() as http:
            await d.wait_until(lambda: d.state.capacity["ram"].observed_at is not None)
            async with http.get(d.api_url + "/readyz") as r:
                assert r.status == 503 and await r.json() == {"status": "not ready"}
            async with http.get(d.api_url + "/status", headers=bearer(READ)) as r:
                doc = await r.json()
            assert "presence not sampled" in doc["not_ready"]
            assert doc["upstreams"]["llm"]["refusal"]["reason"] == "owner_active"
            async with http.post(
                d.proxy_url("llm") + "/v1/chat/completions", json={}, headers=bearer(BORROW)
            ) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "5"
                assert (await r.json())["error"]["code"] == "owner_active"


async def test_admin_switches(lender: RunningDaemon) -> None:
    api, proxy = lender.api_url, lender.proxy_url("llm")
    await lender.wait_ready()
    async with aiohttp.ClientSession() as http:
        async with http.put(
            api + "/admin/lending", json={"enabled": False}, headers=bearer(ADMIN)
        ) as r:
            assert r.status == 200 and await r.json() == {"lending_enabled": False, "changed": True}
        async with http.post(proxy + "/v1/chat/completions", json={}, headers=bearer(BORROW)) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "300"
            body = await r.json()
            assert body["error"]["code"] == "lending_disabled"
        async with http.put(
            api + "/admin/lending", json={"enabled": True}, headers=bearer(ADMIN)
        ) as r:
            assert r.status == 200
        async with http.post(proxy + "/v1/chat/completions", json={}, headers=bearer(BORROW)) as r:
            assert r.status == 200

        async with http.put(
            api + "/admin/resources/cpu", json={"enabled": False}, headers=bearer(ADMIN)
        ) as r:
            assert r.status == 200 and (await r.json())["enabled"] is False
        async with http.post(proxy + "/v1/chat/completions", json={}, headers=bearer(BORROW)) as r:
            assert r.status == 503
            err = (await r.json())["error"]
            assert err["code"] == "resource_disabled" and err["resource"] == "cpu"
        async with http.put(
            api + "/admin/resources/gpu9", json={"enabled": False}, headers=bearer(ADMIN)
        ) as r:
            assert r.status == 404 and "ram" in (await r.json())["error"]["message"]
        for bad in (b"{", b'{"enabled": "yes"}', b'{"enabled": true, "x": 1}', b"[]"):
            async with http.put(api + "/admin/lending", data=bad, headers=bearer(ADMIN)) as r:
                assert r.status == 400, bad


async def test_status_and_metrics_describe_the_state(lender: RunningDaemon) -> None:
    await lender.wait_ready()
    async with aiohttp.ClientSession() as http:
        async with http.get(lender.api_url + "/status", headers=bearer(READ)) as r:
            doc: dict[str, Any] = await r.json()
        async with http.get(lender.api_url + "/metrics", headers=bearer(READ)) as r:
            text = await r.text()
    assert doc["ready"] and doc["lending_enabled"]
    assert doc["presence"]["source"] == "headless" and doc["presence"]["sampled"]
    ram, cpu = doc["resources"]["ram"], doc["resources"]["cpu"]
    assert ram["quality"] == "ready" and ram["free_mib"] > 0 and ram["total_mib"] >= ram["free_mib"]
    assert cpu["free_mib"] is None and 0 <= cpu["utilization_ratio"] <= 1
    up = doc["upstreams"]["llm"]
    assert up["listener"]["bound"] and up["listener"]["address"] == lender.daemon.bound["llm"]
    assert up["lendable"] and up["refusal"] is None and up["active_work"] == []

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("vacancyd_lending_enabled", ())] == 1
    assert samples[("vacancyd_resource_quality", (("quality", "ready"), ("resource", "ram")))] == 1
    assert samples[("vacancyd_resource_free_bytes", (("resource", "ram"),))] > 0
    assert ("vacancyd_resource_free_bytes", (("resource", "cpu"),)) not in samples
    assert ("vacancyd_resource_utilization_ratio", (("resource", "cpu"),)) in samples
    assert samples[("vacancyd_active_work", (("phase", "forwarding"), ("upstream", "llm")))] == 0
    assert samples[("vacancyd_auth_total", (("outcome", "allowed"), ("scope", "read")))] >= 1
    assert samples[("vacancyd_ready", ())] == 1

    rendered = format_status(StatusDocument.from_json(doc))
    assert "lending: on" in rendered and "llm [openai]" in rendered and "lendable" in rendered


async def test_metrics_speak_openmetrics_when_asked(lender: RunningDaemon) -> None:
    """``Accept: application/openmetrics-text`` gets OpenMetrics 1.0 (what Prometheus asks
    for first, and what carries exemplars); anything else the Prometheus text format."""
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )

    await lender.wait_ready()
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    async with aiohttp.ClientSession() as http:
        async with http.get(
            lender.api_url + "/metrics", headers={**bearer(READ), "Accept": accept}
        ) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            text = await r.text()
        async with http.get(lender.api_url + "/metrics", headers=bearer(READ)) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            plain = await r.text()
    assert text.endswith("# EOF\n") and not plain.endswith("# EOF\n")
    names = {fam.name for fam in openmetrics_families(text)}  # type: ignore[no-untyped-call]
    assert {"vacancyd_lending_enabled", "vacancyd_ready", "vacancyd_auth"} <= names


async def test_status_cli_against_a_live_daemon(
    lender: RunningDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    await lender.wait_ready()
    lender.state.set_lending(False)
    import asyncio

    code = await asyncio.to_thread(main, ["status", "--url", lender.api_url, "--token", READ])
    out = capsys.readouterr().out
    assert code == 0
    assert "lending: OFF" in out and "refusing lending_disabled" in out
    code = await asyncio.to_thread(main, ["status", "--url", lender.api_url])
    assert code == 1 and "401" in capsys.readouterr().err
    code = await asyncio.to_thread(main, ["status", "--url", "http://127.0.0.1:9"])
    assert code == 1 and "cannot read" in capsys.readouterr().err


async def test_api_errors_are_json_and_deep_bodies_are_400(lender: RunningDaemon) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(lender.api_url + "/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with http.post(lender.api_url + "/status", headers=bearer(READ)) as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
        deep = b"[" * 5000 + b"]" * 5000
        async with http.put(
            lender.api_url + "/admin/lending", data=deep, headers=bearer(ADMIN)
        ) as r:
            assert r.status == 400 and "too deeply" in (await r.json())["error"]["message"]
    assert lender.state.lending_enabled


async def test_status_cli_refuses_what_is_not_vacancyd(capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    from aiohttp import web

    app = web.Application()

    async def other(_: web.Request) -> web.Response:
        return web.json_response({"hello": "world"})

    app.router.add_get("/status", other)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"\x00\x01 not http\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with serve_app(app) as url:
            code = await asyncio.to_thread(main, ["status", "--url", url])
            assert code == 1 and "not a vacancyd /status document" in capsys.readouterr().err
        code = await asyncio.to_thread(main, ["status", "--url", f"http://127.0.0.1:{port}"])
        assert code == 1 and "cannot read" in capsys.readouterr().err
    finally:
        server.close()
        await server.wait_closed()


async def test_status_cli_names_a_value_of_the_wrong_shape(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``vacancyd status`` reads the answer into the typed document: a value of the wrong
    type is refused with its path, not rendered as if it were right."""
    import asyncio

    from aiohttp import web

    from tests.unit.test_status_model import MINIMAL

    app = web.Application()
    wrong = {**MINIMAL, "presence": {**MINIMAL["presence"], "sampled": "yes"}}

    async def answer(_: web.Request) -> web.Response:
        return web.json_response(wrong)

    app.router.add_get("/status", answer)
    async with serve_app(app) as url:
        code = await asyncio.to_thread(main, ["status", "--url", url])
    err = capsys.readouterr().err
    assert code == 1 and "status.presence.sampled: expected true or false" in err


async def test_status_cli_token_from_file_or_environment(
    lender: RunningDaemon,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    import asyncio

    await lender.wait_ready()
    token_file = tmp_path / "read.token"
    token_file.write_text(READ + "\n")
    code = await asyncio.to_thread(
        main, ["status", "--url", lender.api_url, "--token-file", str(token_file)]
    )
    assert code == 0 and "lending: on" in capsys.readouterr().out
    monkeypatch.setenv("VACANCYD_TOKEN", READ)
    code = await asyncio.to_thread(main, ["status", "--url", lender.api_url])
    assert code == 0
    capsys.readouterr()
    code = await asyncio.to_thread(
        main, ["status", "--url", lender.api_url, "--token-file", str(tmp_path / "nope")]
    )
    assert code == 2 and "--token-file" in capsys.readouterr().err


async def test_an_operator_switch_is_handed_to_the_reclaimer_at_once() -> None:
    """Turning lending or a resource back on must let the reclaimer warm what was unloaded
    now, not at the next sample (``make_api``'s ``switched``); an unchanged switch and a
    refused request call nothing."""
    daemon = Daemon(parse_config(daemon_toml(upstream("up", "http://127.0.0.1:9")), "<test>"))
    calls: list[str] = []
    api = make_api(
        daemon.state,
        Authenticator([], trust_loopback=True, metrics=daemon.metrics),
        daemon.metrics,
        started_at=0.0,
        release=daemon.work.admin_release,
        reclaim=daemon.reclaimer.reclaim,
        switched=lambda: calls.append("switched"),
    )
    async with serve_app(api) as url, aiohttp.ClientSession() as http:
        for enabled, expect in ((False, 1), (False, 1), (True, 2)):
            async with http.put(url + "/admin/lending", json={"enabled": enabled}) as r:
                assert r.status == 200
            assert len(calls) == expect
        resource = next(iter(daemon.state.switches))
        async with http.put(url + f"/admin/resources/{resource}", json={"enabled": False}) as r:
            assert r.status == 200
        assert len(calls) == 3
        async with http.put(url + "/admin/lending", json={"enabled": "yes"}) as r:
            assert r.status == 400
        assert len(calls) == 3
