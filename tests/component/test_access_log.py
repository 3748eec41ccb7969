"""Access lines (vacancyd/web/access.py, vacancyd/proxy/observe.py, vacancyd/runtime/logging.py):
every listener writes one shape of line with the same structured fields in the same order,
timestamps are RFC 3339 UTC, and a refusal flood is one full line plus one counted summary
per (listener, reason) and window while admitted requests keep one line each."""

from __future__ import annotations

import asyncio
import calendar
import json
import logging
import re
import time

import aiohttp
import pytest

from tests.support.daemon import openai_like_app, running_daemon, serve_app, single_upstream_toml
from tests.support.fake_kube import FakeKube
from tests.support.k8s_lender import follower_toml
from vacancyd.config.load import parse_companion_config
from vacancyd.k8s.companion import Companion
from vacancyd.runtime.logging import JsonLineFormatter, TextFormatter
from vacancyd.web import access
from vacancyd.web.access import FIELDS, MAX_CLIENTS, SUMMARY_FIELDS, RefusalLog

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
#: The text shape of an access line, whichever listener wrote it.
LINE = re.compile(
    r'^(?P<client>\S+) "(?P<method>[A-Z]+) (?P<path>\S+) HTTP/(?P<version>\d\.\d)" '
    r"(?P<status>\d{3}) (?P<bytes>\d+) (?P<duration>\d+\.\d{3})s "
    r"class=(?P<klass>[a-z]+) reason=(?P<reason>[a-z_]+|-) borrower=(?P<borrower>[a-z0-9_.-]+)$"
)
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def access_records(caplog: pytest.LogCaptureFixture, listener: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == f"vacancyd.access.{listener}"]


def json_of(record: logging.LogRecord) -> dict[str, object]:
    formatter = JsonLineFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s", rename_fields={"levelname": "level"}
    )
    out = json.loads(formatter.format(record))
    assert isinstance(out, dict)
    return out


async def test_api_and_proxy_access_lines_have_one_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="vacancyd.access")
    app, _ = openai_like_app()
    async with (
        serve_app(app) as base,
        running_daemon(single_upstream_toml(api=0, proxy=0, target=base)) as d,
    ):
        await d.wait_ready()
        async with aiohttp.ClientSession() as http:
            async with http.post(d.proxy_url("up") + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
                await r.read()
            async with http.get(d.api_url + "/healthz") as r:
                assert r.status == 200
                await r.read()
        proxy = [r for r in access_records(caplog, "up") if "POST" in r.getMessage()]
        api = [r for r in access_records(caplog, "api") if "/healthz" in r.getMessage()]
    assert len(proxy) == 1 and len(api) == 1
    for record, listener, klass in ((proxy[0], "up", "work"), (api[0], "api", "api")):
        text = LINE.match(record.getMessage())
        assert text is not None, record.getMessage()
        assert text["klass"] == klass and text["reason"] == "-"
        doc = json_of(record)
        assert list(doc)[:4] == ["asctime", "level", "name", "message"]
        assert list(doc)[4:] == list(FIELDS)  # the same fields, in the same order
        assert doc["listener"] == listener and doc["route_class"] == klass
        assert doc["client"] == text["client"] == "127.0.0.1"
        assert doc["method"] == text["method"] and doc["path"] == text["path"]
        assert doc["http_version"] == text["version"] == "1.1"
        assert doc["status"] == int(text["status"]) == 200
        assert doc["bytes"] == int(text["bytes"]) > 0
        assert doc["reason"] is None
        # The proxy's request is the unnamed borrower's (trusted loopback); the API's no one's.
        shown = "default" if listener == "up" else None
        assert doc["borrower"] == shown and text["borrower"] == (shown or "-")


async def test_the_companion_health_listener_writes_the_same_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="vacancyd.access")
    toml = follower_toml("http://127.0.0.1:9", timeout_s=1.0, poll_s=30.0, ns="vacancy")
    companion = Companion(parse_companion_config(toml, "<test>"), connect=FakeKube().connect)
    await companion.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://{companion.address}/metrics") as r:
                assert r.status == 200
                await r.read()
    finally:
        await companion.stop()
    (record,) = [r for r in access_records(caplog, "companion") if "/metrics" in r.getMessage()]
    text = LINE.match(record.getMessage())
    assert text is not None, record.getMessage()
    assert text["klass"] == "api" and text["path"] == "/metrics"
    doc = json_of(record)
    assert list(doc)[4:] == list(FIELDS)
    assert doc["listener"] == "companion" and doc["status"] == 200


def test_timestamps_are_rfc3339_utc_with_milliseconds() -> None:
    record = logging.LogRecord("vacancyd.test", logging.INFO, __file__, 1, "hello", None, None)
    record.created = calendar.timegm((2026, 12, 2, 7, 1, 2)) + 0.1234
    record.msecs = 123.4
    text = TextFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s").format(record)
    assert text == "2026-12-02T07:01:02.123Z INFO    vacancyd.test: hello"
    doc = json_of(record)
    assert doc["asctime"] == "2026-12-02T07:01:02.123Z"
    # a fresh record: now, in UTC whatever the local zone says
    now = logging.LogRecord("vacancyd.test", logging.INFO, __file__, 1, "now", None, None)
    stamp = str(json_of(now)["asctime"])
    assert RFC3339_UTC.match(stamp), stamp
    assert stamp.startswith(time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now.created)))


async def test_a_refusal_flood_is_one_line_and_one_counted_summary_per_reason(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(access, "WINDOW_S", 600.0)  # one window for the whole test
    caplog.set_level(logging.INFO, logger="vacancyd.access")
    app, _ = openai_like_app()
    url_admin = "/admin/pause"
    async with (
        serve_app(app) as base,
        running_daemon(single_upstream_toml(api=0, proxy=0, target=base)) as d,
    ):
        await d.wait_ready()
        url = d.proxy_url("up") + "/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            for _ in range(2):  # admitted work: one line each
                async with http.post(url, json=CHAT) as r:
                    assert r.status == 200
                    await r.read()
            d.state.set_lending(False)
            for _ in range(5):
                async with http.post(url, json=CHAT) as r:
                    assert r.status == 503
                    assert (await r.json())["error"]["code"] == "lending_disabled"
            d.state.set_lending(True)
            async with http.post(d.api_url + url_admin, json={}) as r:
                assert r.status == 200, await r.text()
            for _ in range(3):
                async with http.post(url, json=CHAT) as r:
                    assert r.status == 503
                    assert (await r.json())["error"]["code"] == "owner_active"
        during = list(access_records(caplog, "up"))
    after = access_records(caplog, "up")  # the daemon flushed its windows when it stopped
    lines = [r for r in during if LINE.match(r.getMessage())]
    assert [r.__dict__["reason"] for r in lines] == [
        None,
        None,
        "lending_disabled",
        "owner_active",
    ]
    assert [r.__dict__["status"] for r in lines] == [200, 200, 503, 503]
    summaries = {r.__dict__["reason"]: r for r in after if "more refusals" in r.getMessage()}
    assert set(summaries) == {"lending_disabled", "owner_active"}
    assert summaries["lending_disabled"].__dict__["count"] == 4
    assert summaries["owner_active"].__dict__["count"] == 2
    for reason, summary in summaries.items():
        assert summary.levelno == logging.INFO
        assert f"reason={reason}" in summary.getMessage()
        assert summary.__dict__["top_client"] == "127.0.0.1"
        assert summary.__dict__["clients"] == 1
        assert summary.__dict__["listener"] == "up"
        assert list(json_of(summary))[4:] == list(SUMMARY_FIELDS)


async def test_at_debug_level_every_refusal_has_its_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="vacancyd.access")
    app, _ = openai_like_app()
    async with (
        serve_app(app) as base,
        running_daemon(single_upstream_toml(api=0, proxy=0, target=base)) as d,
    ):
        await d.wait_ready()
        d.state.set_lending(False)
        url = d.proxy_url("up") + "/v1/chat/completions"
        async with aiohttp.ClientSession() as http:
            for _ in range(4):
                async with http.post(url, json=CHAT) as r:
                    assert r.status == 503
                    await r.read()
    lines = [r for r in access_records(caplog, "up") if LINE.match(r.getMessage())]
    assert [r.__dict__["reason"] for r in lines] == ["lending_disabled"] * 4
    assert not [r for r in access_records(caplog, "up") if "more refusals" in r.getMessage()]


async def test_a_window_closes_by_itself_and_the_next_refusal_has_a_full_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("vacancyd.access.unit")
    caplog.set_level(logging.INFO, logger="vacancyd.access.unit")
    refusals = RefusalLog(window_s=0.01)
    assert refusals.first(logger, "unit", "resource_busy", 503, "10.0.0.1")
    for _ in range(20):
        assert not refusals.first(logger, "unit", "resource_busy", 503, "10.0.0.9")
    for i in range(MAX_CLIENTS + 10):  # 255 more named, 11 counted as unnamed
        assert not refusals.first(logger, "unit", "resource_busy", 503, f"10.1.{i // 250}.{i}")
    for _ in range(100):  # the window's timer writes the summary (no waiting on a clock)
        if caplog.records:
            break
        await asyncio.sleep(0.01)
    (summary,) = caplog.records
    assert summary.__dict__["count"] == MAX_CLIENTS + 30
    assert summary.__dict__["top_client"] == "10.0.0.9"
    assert summary.__dict__["clients"] == MAX_CLIENTS + 1  # the unnamed ones as one more
    assert "from 257+ clients" in summary.getMessage()
    # the window is closed: the next refusal has its own line again
    assert refusals.first(logger, "unit", "resource_busy", 503, "10.0.0.1")
    refusals.flush()  # nothing beyond the first: no summary
    assert len(caplog.records) == 1


def test_without_an_event_loop_every_refusal_has_its_line() -> None:
    logger = logging.getLogger("vacancyd.access.unit")
    refusals = RefusalLog()
    assert all(refusals.first(logger, "unit", "owner_active", 503, "::1") for _ in range(3))
