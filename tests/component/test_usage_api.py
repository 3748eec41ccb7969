"""``GET /usage`` on a live daemon (read scope) and ``vacancyd usage --url`` against it; the
ledger is opened at start, in state_dir, and its error shows in /status."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.component.test_api import ADMIN, BORROW, READ, bearer, config
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from vacancyd.cli import format_status, main
from vacancyd.core.status import StatusDocument
from vacancyd.core.usage import UsageRow
from vacancyd.runtime.usage import USAGE_FILE, read_groups


@pytest.fixture
async def lender() -> AsyncIterator[RunningDaemon]:
    app, _ = openai_like_app()
    text = 'energy_price_per_kwh = 0.5\nenergy_currency = "EUR"\n'
    async with serve_app(app) as url, running_daemon(text + config(url)) as d:
        yield d


def job(job_id: int, borrower: str, model: str, energy_j: float | None) -> UsageRow:
    now = time.time()
    return UsageRow(
        job_id=job_id,
        borrower=borrower,
        upstream="llm",
        model=model,
        resource="ram",
        started_at=now - 30,
        ended_at=now - 20,
        outcome="completed",
        prompt_tokens=5,
        completion_tokens=7,
        energy_j=energy_j,
        bytes_in=10,
        bytes_out=20,
    )


async def record(lender: RunningDaemon) -> None:
    store = lender.daemon.usage
    assert store.path == lender.daemon.settings.state_dir / USAGE_FILE
    for f in (
        store.record(job(1, "", "qwen", 3_600_000.0)),
        store.record(job(2, "friend", "qwen", None)),
        store.record(job(3, "friend", "llama", 1_800_000.0)),
    ):
        await asyncio.wrap_future(f)


async def test_usage_needs_read_scope_and_groups_the_ledger(lender: RunningDaemon) -> None:
    await record(lender)
    api = lender.api_url
    async with aiohttp.ClientSession() as http:
        async with http.get(api + "/usage") as r:
            assert r.status == 401
        async with http.get(api + "/usage", headers=bearer(BORROW)) as r:
            assert r.status == 403
        body: dict[str, object] = {}
        for token in (READ, ADMIN):
            async with http.get(api + "/usage", headers=bearer(token)) as r:
                assert r.status == 200
                body = await r.json()
        assert body["by"] == "borrower" and body["since"] == "24h"
        assert body["rows"] == [
            {
                "borrower": "default",
                "requests": 1,
                "busy_s": 10.0,
                "prompt_tokens": 5,
                "completion_tokens": 7,
                "energy_j": 3_600_000.0,
                "energy_kwh": 1.0,
                "cost": 0.5,
                "currency": "EUR",
            },
            {
                "borrower": "friend",
                "requests": 2,
                "busy_s": 20.0,
                "prompt_tokens": 10,
                "completion_tokens": 14,
                "energy_j": 1_800_000.0,
                "energy_kwh": 0.5,
                "cost": 0.25,
                "currency": "EUR",
            },
        ]
        async with http.get(api + "/usage?by=model&since=1h", headers=bearer(READ)) as r:
            rows = (await r.json())["rows"]
        assert [(x["model"], x["requests"]) for x in rows] == [("llama", 1), ("qwen", 2)]
        for query, word in (("since=yesterday", "yesterday"), ("by=upstream", "upstream")):
            async with http.get(api + "/usage?" + query, headers=bearer(READ)) as r:
                assert r.status == 400
                err = (await r.json())["error"]
                assert err["code"] == "bad_request" and word in err["message"]
        async with http.get(api + "/status", headers=bearer(READ)) as r:
            doc = StatusDocument.from_json(await r.json())
        assert doc.durable_state.usage_ledger_error is None


async def test_usage_cli_reads_the_api(
    lender: RunningDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    await record(lender)
    argv = ["usage", "--url", lender.api_url, "--token", READ, "--by", "day", "--format", "json"]
    assert await asyncio.to_thread(main, argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["rows"]
    (row,) = out["rows"]
    assert row["requests"] == 3 and len(row["day"]) == 10
    code = await asyncio.to_thread(main, ["usage", "--url", lender.api_url, "--token", BORROW])
    assert code == 1 and "403" in capsys.readouterr().err


def set_aside(state_dir: Path) -> int:
    return len(list(state_dir.glob(f"{USAGE_FILE}.corrupt-*")))


async def test_a_corrupt_ledger_is_set_aside_at_start_and_shown_in_status(
    tmp_path: Path,
) -> None:
    (tmp_path / USAGE_FILE).write_bytes(b"definitely not sqlite" * 64)
    app, _ = openai_like_app()
    text = f'state_dir = "{tmp_path}"\n'
    async with serve_app(app) as url, running_daemon(text + config(url)) as d:
        async with aiohttp.ClientSession() as http:
            async with http.get(d.api_url + "/status", headers=bearer(READ)) as r:
                doc = StatusDocument.from_json(await r.json())
        error = doc.durable_state.usage_ledger_error
        assert error is not None and "set aside" in error
        assert f"usage ledger: {error}" in format_status(doc).splitlines()
        assert await asyncio.to_thread(set_aside, tmp_path) == 1
        await asyncio.wrap_future(d.daemon.usage.record(job(1, "", "qwen", None)))
    # the fresh ledger holds the new row, and the daemon closed it at its stop
    groups = await asyncio.to_thread(read_groups, tmp_path / USAGE_FILE, 0.0, "borrower")
    assert groups[0].requests == 1
