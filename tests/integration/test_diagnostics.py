"""``GET /admin/diagnostics`` and ``PUT /admin/debug`` on a real daemon whose presence comes
from the logind look-alike on a private D-Bus: the bundle has what a bug report needs and
none of the tokens, credentials or session user names."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from e2e.test_daemon_process import free_port
from tests.support.config import daemon_toml, token, upstream
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.dbus import PrivateBus, private_bus
from tests.support.fake_logind import FakeLogind, SessionSpec

USER = "alice-diag"
INLINE = "inline-token-0123456789"
FILED = "filed-token-9876543210"
CREDENTIAL = "upstream-credential-abcdef"


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[PrivateBus]:
    with private_bus(tmp_path) as running:
        yield running


def config(address: str, target: str, tmp: Path) -> str:
    (tmp / "read.token").write_text(FILED + "\n")
    (tmp / "llama.key").write_text(CREDENTIAL)
    return daemon_toml(
        upstream("chat", target),
        upstream(
            "llama",
            f"http://127.0.0.1:{free_port()}",
            adapter="llamacpp",
            credential_file=tmp / "llama.key",
        ),
        tokens=(
            token("cluster", INLINE, "borrow"),
            token("prometheus", "", "read", token_file=tmp / "read.token"),
        ),
        owner={"presence": "logind", "bus_address": address},
        collectors={"poll_s": 0.2, "probe_timeout_s": 0.5},
    )


@pytest.mark.dbus
async def test_diagnostics_bundle_is_complete_and_redacted(bus: PrivateBus, tmp_path: Path) -> None:
    fake = await FakeLogind.start(bus.address, [SessionSpec("2", user=USER)])
    app, _ = openai_like_app()
    try:
        async with serve_app(app) as target:
            async with running_daemon(config(bus.address, target, tmp_path)) as d:
                state = d.state
                await d.wait_until(lambda: state.presence.reading.value is not None, 10)
                await d.wait_until(lambda: state.servers.get("llama") is not None, 10)
                # an error message that names the session's user, as a collector might
                state.record_presence_failure(f"cannot read the session of {USER}", state.clock())
                async with aiohttp.ClientSession() as http:
                    async with http.get(f"{d.api_url}/admin/diagnostics") as resp:
                        assert resp.status == 200
                        text = await resp.text()
    finally:
        await fake.stop()
    for secret in (INLINE, FILED, CREDENTIAL, USER):
        assert secret not in text, f"{secret!r} leaked into the diagnostics bundle"
    doc = json.loads(text)
    assert doc["versions"]["vacancyd"] and doc["versions"]["aiohttp"]
    assert doc["config"]["server"]["tokens"][0]["token"] == "[redacted]"
    assert doc["config"]["server"]["tokens"][1]["token_file"].endswith("read.token")
    assert doc["config"]["upstream"][1]["credential_file"].endswith("llama.key")
    assert set(doc["status"]["upstreams"]) == {"chat", "llama"}
    sources = {e["source"]: e["error"] for e in doc["collector_errors"]}
    assert "server llama" in sources  # nothing listens at its target
    assert sources["presence"] == "cannot read the session of [redacted]"
    kinds = {e["kind"] for e in doc["recent_events"]}
    assert "presence" in kinds or "veto" in kinds
    assert doc["debug"]["active"] is False


async def test_debug_window_raises_logging_and_falls_back_by_itself() -> None:
    app, _ = openai_like_app()
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.INFO)
    try:
        async with serve_app(app) as target:
            toml = daemon_toml(upstream("chat", target), collectors={"poll_s": None})
            async with running_daemon(toml) as d, aiohttp.ClientSession() as http:
                url = f"{d.api_url}/admin/debug"
                for bad in ({}, {"minutes": -1}, {"minutes": 241}, {"minutes": True}, [1]):
                    async with http.put(url, json=bad) as resp:
                        assert resp.status == 400, bad
                async with http.put(url, json={"minutes": 0.02}) as resp:  # 1.2 s
                    assert resp.status == 200
                    view = await resp.json()
                assert view["active"] is True and view["level"] == "DEBUG"
                assert 0 < view["remaining_s"] <= 1.2
                assert root.level == logging.DEBUG
                await asyncio.sleep(1.6)
                assert root.level == logging.INFO, "the window did not close by itself"
                async with http.put(url, json={"minutes": 10}) as resp:
                    assert (await resp.json())["active"] is True
                async with http.put(url, json={"minutes": 0}) as resp:
                    assert (await resp.json()) == {
                        "active": False,
                        "remaining_s": None,
                        "level": "INFO",
                    }
                assert root.level == logging.INFO
    finally:
        root.setLevel(before)
