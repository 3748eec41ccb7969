"""The owner's status page (``GET /`` on the API listener) in a real headless Chromium.

The page is loaded from a real daemon, rendered by the browser's own engine, and must show
what ``/status`` says and follow ``/events`` live: switching lending off through the admin
API changes what the open page shows without a reload.
"""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.support.chromium import chromium_page
from tests.support.daemon import running_daemon, serve_app
from tests.support.held_openai import HeldOpenAI
from tests.support.lender import config
from vacancyd.core.history import HistorySample, ResourceSample
from vacancyd.core.usage import UsageRow

READ = "read-token-for-the-page-0123"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


async def test_page_is_self_contained_with_a_strict_policy() -> None:
    async with running_daemon(config("http://127.0.0.1:9", adapter="openai")) as d:
        async with aiohttp.ClientSession() as http, http.get(d.api_url + "/") as resp:
            assert resp.status == 200
            assert resp.content_type == "text/html"
            html = await resp.text()
            csp = resp.headers["Content-Security-Policy"]
    # nothing fetched from anywhere else: no absolute URLs in src/href, connections only back
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'", csp)


async def test_page_renders_and_follows_lending_switch(tmp_path: Path) -> None:
    async with running_daemon(config("http://127.0.0.1:9", adapter="openai")) as d:
        await d.wait_ready()
        async with chromium_page(d.api_url + "/") as page:
            summary = "document.getElementById('summary').textContent"
            assert await page.wait_for(f"{summary} === 'lendable' && {summary}")
            rows = await page.evaluate(
                "Array.from(document.querySelectorAll('#upstreams tbody tr'))"
                ".map(r => r.cells[0].textContent + ':' + r.cells[1].textContent)"
            )
            assert rows == ["up:yes"]
            resources = await page.evaluate(
                "document.querySelector('#resources tbody').textContent"
            )
            assert "ram" in resources and "GiB" in resources
            assert await page.wait_for("document.getElementById('conn').textContent === 'live'")
            # the 24-hour timeline is there when the page opens, drawn from the history the
            # daemon has recorded since it started: not an empty box
            assert await page.wait_for(f"{HISTORY_SVG} !== null")
            drawn = await page.evaluate(TIMELINE_FACTS)
            assert drawn["title"] == "Lending over the last 24 hours"
            assert drawn["desc"].startswith("History covers"), drawn
            assert "lending on" in drawn["tips"] and "owner away" in drawn["tips"]
            assert drawn["width"] > 600 and drawn["height"] > 200  # laid out, not collapsed
            before = await page.screenshot(tmp_path / "lendable.png")
            await page.evaluate("document.getElementById('history').scrollIntoView(); true")
            await page.screenshot(tmp_path / "timeline-24h.png")
            await page.evaluate("window.scrollTo(0, 0); true")

            async with (
                aiohttp.ClientSession() as http,
                http.put(d.api_url + "/admin/lending", json={"enabled": False}) as resp,
            ):
                assert resp.status == 200

            # no reload: the /events stream drives the update
            assert await page.wait_for(f"{summary} === 'lending off'")
            why = await page.evaluate("document.getElementById('why').textContent")
            assert "switched off" in why
            timeline = await page.wait_for(
                "document.getElementById('timeline').textContent.includes('lending')"
                " && document.getElementById('timeline').textContent"
            )
            assert "Lending switched off" in timeline and "{" not in timeline
            cells = await page.evaluate(
                "document.querySelector('#upstreams tbody tr').cells[1].textContent"
            )
            assert cells == "no"
            after = await page.screenshot(tmp_path / "lending-off.png")
    assert _png_size(before) == _png_size(after) == (1200, 900)
    assert before.read_bytes() != after.read_bytes()


@pytest.mark.parametrize("good_token", [True, False])
async def test_page_asks_for_a_read_token_when_not_trusted(good_token: bool) -> None:
    toml = config("http://127.0.0.1:9", adapter="openai").replace(
        "trust_loopback = true",
        f'trust_loopback = false\n[[server.tokens]]\nname = "page"\ntoken = "{READ}"\n'
        'scopes = ["read"]',
    )
    async with running_daemon(toml) as d:
        await d.wait_ready()
        async with chromium_page(d.api_url + "/") as page:
            summary = "document.getElementById('summary').textContent"
            assert await page.wait_for(f"{summary} === 'needs a read token'")
            assert await page.evaluate("getComputedStyle(document.getElementById('auth')).display")
            token = READ if good_token else "wrong-token-000000000000"
            await page.evaluate(
                f"document.getElementById('token').value = {token!r};"
                "document.getElementById('auth').requestSubmit(); true"
            )
            if good_token:
                assert await page.wait_for(f"{summary} === 'lendable'")
                assert await page.wait_for("document.getElementById('conn').textContent === 'live'")
            else:
                await page.wait_for(f"{summary} === 'needs a read token'")
                shown = await page.evaluate("document.body.innerText")
                assert "lendable\n" not in shown


async def test_vacancyd_open_logs_the_page_in_once_without_a_pasted_token(tmp_path: Path) -> None:
    """``vacancyd open --print`` (run as the same user as the browser) gives a link that
    opens the page with data on a token-guarded daemon; the link works once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = tmp_path / "read.token"
    secret.write_text(READ + "\n")
    secret.chmod(0o600)
    toml = config("http://127.0.0.1:9", adapter="openai").replace(
        "trust_loopback = true",
        f'trust_loopback = false\n[[server.tokens]]\nname = "page"\ntoken_file = "{secret}"\n'
        'scopes = ["read"]',
    )
    toml = toml.replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"', 1)
    path = tmp_path / "vacancyd.toml"
    path.write_text(toml)
    async with running_daemon(toml) as d:
        await d.wait_ready()
        assert d.api_url == f"http://127.0.0.1:{port}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "vacancyd",
            "open",
            "--print",
            "--config",
            str(path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        link = out.decode().strip()
        assert link.startswith(d.api_url + "/#login=") and READ not in link
        assert b"works once" in err
        async with chromium_page(link) as page:
            summary = "document.getElementById('summary').textContent"
            assert await page.wait_for(f"{summary} === 'lendable'")
            assert await page.wait_for("document.getElementById('conn').textContent === 'live'")
            assert await page.evaluate("location.hash") == ""  # the ticket left the address bar
            assert not await page.evaluate(
                "getComputedStyle(document.getElementById('auth')).display !== 'none'"
            )
            await page.screenshot(tmp_path / "opened.png")
        async with chromium_page(link) as page:  # a second browser: the link is spent
            shown = await page.wait_for("document.getElementById('loginerr').textContent")
            assert "used already or has expired" in shown
            assert await page.wait_for(f"{summary} === 'needs a read token'")


TIMELINE = "document.getElementById('timeline').innerText"
HISTORY_SVG = "document.querySelector('#history > svg')"
#: What the drawn timeline shows: its accessible name and description, the tooltips of its
#: bands (their first words), its texts and its size on the page.
TIMELINE_FACTS = f"""(() => {{
  const svg = {HISTORY_SVG};
  const box = svg.getBoundingClientRect();
  return {{
    title: svg.querySelector(':scope > title').textContent,
    desc: svg.querySelector(':scope > desc').textContent,
    tips: Array.from(svg.querySelectorAll('rect > title'))
      .map(t => t.textContent.split(/ \\d/)[0]),
    texts: Array.from(svg.querySelectorAll('text')).map(t => t.textContent),
    width: box.width, height: box.height,
    elements: Array.from(svg.querySelectorAll('*')).map(e => e.localName),
  }};
}})()"""
SUMMARY = "document.getElementById('summary').textContent"


async def test_page_says_busy_while_every_slot_is_taken(tmp_path: Path) -> None:
    """The gate would admit, but the only slot is taken and a new request gets 503
    resource_busy: the page says busy, not lendable, and why."""
    held = HeldOpenAI()
    async with (
        serve_app(held.app()) as target,
        running_daemon(config(target, adapter="openai")) as d,
    ):
        await d.wait_ready()
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(
                http.post(
                    d.proxy_url("up") + "/v1/chat/completions",
                    json={"model": "tiny", "user": "a", "messages": []},
                )
            )
            await held.until_arrived(1)
            async with http.post(
                d.proxy_url("up") + "/v1/chat/completions",
                json={"model": "tiny", "user": "b", "messages": []},
            ) as second:
                assert second.status == 503
                assert (await second.json())["error"]["code"] == "resource_busy"
            async with chromium_page(d.api_url + "/") as page:
                assert await page.wait_for(f"{SUMMARY} === 'busy'")
                why = await page.evaluate("document.getElementById('why').textContent")
                assert "every slot is taken (1 of 1)" in why
                row = await page.evaluate(
                    "Array.from(document.querySelector('#upstreams tbody tr').cells)"
                    ".map(c => c.textContent)"
                )
                assert row[1] == "busy" and "1 of 1 taken" in row[3]
                assert await page.evaluate("document.querySelector('#work tbody').rows.length") == 1
                borrower = "document.querySelector('#work tbody tr').cells[1].textContent"
                assert await page.evaluate(borrower) == "default"  # the shared borrow token
                assert await page.evaluate("document.getElementById('nowork').hidden")
                await page.screenshot(tmp_path / "busy.png")
                held.release("a")
                async with await first as reply:
                    assert reply.status == 200
                assert await page.wait_for(f"{SUMMARY} === 'lendable'")
                assert await page.wait_for("!document.getElementById('nowork').hidden")
                await page.screenshot(tmp_path / "free-again.png")


async def test_page_claims_nothing_before_it_has_data(tmp_path: Path) -> None:
    toml = config("http://127.0.0.1:9", adapter="openai").replace(
        "trust_loopback = true",
        f'trust_loopback = false\n[[server.tokens]]\nname = "page"\ntoken = "{READ}"\n'
        'scopes = ["read"]',
    )
    async with running_daemon(toml) as d:
        await d.wait_ready()
        async with chromium_page(d.api_url + "/") as page:
            assert await page.wait_for(f"{SUMMARY} === 'needs a read token'")
            shown = await page.evaluate("document.body.innerText")
            assert "Nobody is borrowing" not in shown
            assert "lendable" not in shown.replace("lendable\twhy", "")
            await page.screenshot(tmp_path / "no-data.png")


async def test_transitions_read_as_words_and_the_last_hour_shows_on_opening(
    tmp_path: Path,
) -> None:
    async with running_daemon(config("http://127.0.0.1:9", adapter="openai")) as d:
        await d.wait_ready()
        async with aiohttp.ClientSession() as http:
            for enabled in (False, True):  # before the page is opened
                async with http.put(
                    d.api_url + "/admin/lending", json={"enabled": enabled}
                ) as resp:
                    assert resp.status == 200
            async with http.get(d.api_url + "/events/recent") as resp:
                kinds = [e["kind"] for e in (await resp.json())["events"]]
            assert kinds.count("lending") == 2
            async with chromium_page(d.api_url + "/") as page:
                history = await page.wait_for(
                    f"{TIMELINE}.includes('Lending switched on') && {TIMELINE}"
                )
                assert "Lending switched off" in history
                # newest first
                assert history.index("Lending switched on") < history.index("Lending switched off")
                async with http.put(
                    d.api_url + "/admin/resources/ram", json={"enabled": False}
                ) as resp:
                    assert resp.status == 200
                live = await page.wait_for(
                    f"{TIMELINE}.includes('Resource ram switched off') && {TIMELINE}"
                )
                assert "{" not in live and '"' not in live
                assert live.index("Resource ram switched off") < live.index("Lending switched on")
                await page.screenshot(tmp_path / "timeline.png")


async def test_the_timeline_and_todays_totals_show_each_borrower(tmp_path: Path) -> None:
    """Six hours of history with two borrowers (one named like markup) and today's ledger:
    the page draws their bands with a legend, lists today's totals per borrower, and every
    name stays text."""
    evil = "<img src=x onerror=f()>&co"
    async with running_daemon(config("http://127.0.0.1:9", adapter="openai")) as d:
        await d.wait_ready()
        store = d.daemon.usage
        assert store is not None
        now = time.time()
        for i in range(6 * 60):
            at = now - 6 * 3600 + 60 * i
            borrowers = {"alice": 1} if 60 <= i < 180 else {evil: 2} if 200 <= i < 260 else {}
            sample = HistorySample(
                at,
                owner_present=300 <= i < 330,
                lending=not 300 <= i < 330,
                resources={"gpu0": ResourceSample(1000.0 + 9000 * len(borrowers), 24576.0, 50.0)},
                borrowers=borrowers,
            )
            store.record_history(sample)
        for job_id, who in ((1, "alice"), (2, "alice"), (3, evil)):
            row = UsageRow(
                job_id,
                who,
                "up",
                "tiny",
                "ram",
                now - 30,
                now - 10,
                "completed",
                10,
                5,
                7200.0,
                0,
                0,
            )
            await asyncio.wrap_future(store.record(row))
        async with chromium_page(d.api_url + "/") as page:
            assert await page.wait_for(f"{SUMMARY} === 'lendable'")
            assert await page.wait_for("document.querySelector('#today tbody').rows.length === 2")
            today = await page.evaluate(
                "Array.from(document.querySelectorAll('#today tbody tr'))"
                ".map(r => Array.from(r.cells).map(c => c.textContent))"
            )
            assert today == [
                ["alice", "2", "40 s", "20", "10", "4.0 Wh"],
                [evil, "1", "20 s", "10", "5", "2.0 Wh"],
            ]
            assert await page.evaluate("document.getElementById('notoday').hidden")
            assert await page.wait_for(f"{HISTORY_SVG} !== null")
            drawn = await page.evaluate(TIMELINE_FACTS)
            assert "alice" in drawn["texts"] and evil in drawn["texts"]  # the legend, as text
            assert "owner present" in drawn["tips"] and "lending off" in drawn["tips"]
            assert any(t.startswith("no history before") for t in drawn["texts"])
            assert "alice 2 h" in drawn["desc"]
            assert "img" not in drawn["elements"] and "script" not in drawn["elements"]
            assert await page.evaluate("document.querySelectorAll('img').length") == 0
            # drawn again, under the page's policy: nothing in it is refused
            violations = await page.evaluate(
                "window.violations = [];"
                "document.addEventListener('securitypolicyviolation',"
                " (e) => window.violations.push(e.violatedDirective));"
                "overviewAt = 0; loadOverview()"
                ".then(() => new Promise((r) => setTimeout(r, 300)))"  # reports are queued
                ".then(() => window.violations)"
            )
            assert violations == []
            assert await page.wait_for(f"{HISTORY_SVG} !== null")
            await page.evaluate("document.getElementById('history').scrollIntoView(); true")
            await page.screenshot(tmp_path / "timeline-borrowers.png")
