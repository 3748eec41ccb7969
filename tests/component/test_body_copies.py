"""What a proxy holds of request bodies beyond its budget (vacancyd.proxy.bodies).

Real HTTP uploads to an in-process aiohttp server whose handler buffers them with
:func:`~vacancyd.proxy.bodies.read_body`, as the proxy does. The budget counts the bytes that
arrived; the copies it does not count (a large body joined whole, its facts read) are made
one at a time, a body that fails keeps none of what it sent, and a borrower who leaves while
its body waits to be copied gives its budget back. ``bench/upload_storm.py`` measures the
resulting peak RSS.
"""

from __future__ import annotations

import asyncio
import io
import traceback
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from tests.support.daemon import serve_app
from vacancyd.proxy import bodies

MIB = 1024 * 1024


@asynccontextmanager
async def buffering(budget: bodies.BodyBudget, results: list[object]) -> AsyncIterator[str]:
    """Serve ``POST /`` reading the body into ``budget``; each outcome lands in ``results``
    (the body, or the BodyError with the largest byte count its traceback's frames hold)."""

    async def handle(request: web.Request) -> web.Response:
        try:
            body, reservation = await bodies.read_body(
                request,
                max_bytes=8 * MIB,
                budget=budget,
                read_timeout_s=30,
                idle_timeout_s=30,
            )
        except bodies.BodyError as exc:
            results.append((exc, _largest_held(exc)))
            return web.Response(status=exc.status)
        reservation.release()
        results.append(body)
        return web.Response(text=str(len(body)))

    app = web.Application(client_max_size=16 * MIB)
    app.router.add_post("/", handle)
    async with serve_app(app) as url:
        yield url


async def until(condition: Callable[[], bool]) -> None:
    """Wait (at most 10 s) until ``condition()`` holds: the budget is plain state."""
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 - polling a plain counter
            await asyncio.sleep(0.01)


def _largest_held(exc: BaseException) -> int:
    """The most body bytes any local of the frames in ``exc``'s traceback still holds."""
    largest = 0
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        for value in frame.f_locals.values():
            if isinstance(value, bytes | bytearray):
                largest = max(largest, len(value))
            elif isinstance(value, list):
                largest = max(largest, sum(len(v) for v in value if isinstance(v, bytes)))
    return largest


async def test_large_bodies_are_joined_one_at_a_time() -> None:
    budget = bodies.BodyBudget(32 * MIB)
    results: list[object] = []
    payload = b"x" * (2 * MIB)
    async with buffering(budget, results) as url, aiohttp.ClientSession() as http:
        await budget.copying.acquire()  # another body is being copied
        try:
            post = asyncio.get_running_loop().create_task(http.post(url, data=io.BytesIO(payload)))
            await until(lambda: budget.used_bytes >= len(payload))  # all arrived, counted
            await asyncio.sleep(0.2)
            assert not post.done() and results == [], "joined while another body was copied"
        finally:
            budget.copying.release()
        async with await asyncio.wait_for(post, 10) as resp:
            assert resp.status == 200 and await resp.text() == str(len(payload))
    assert results == [payload]
    assert budget.used_bytes == 0


async def test_a_borrower_leaving_while_its_body_waits_gives_its_budget_back() -> None:
    budget = bodies.BodyBudget(32 * MIB)
    results: list[object] = []
    async with buffering(budget, results) as url:
        await budget.copying.acquire()
        try:
            async with aiohttp.ClientSession() as http:
                post = asyncio.get_running_loop().create_task(
                    http.post(url, data=io.BytesIO(b"y" * (2 * MIB)))
                )
                await until(lambda: budget.used_bytes >= 2 * MIB)
                post.cancel()  # the borrower hangs up while its body waits to be joined
            await until(lambda: budget.used_bytes == 0)
        finally:
            budget.copying.release()
    assert results == []


async def test_a_body_refused_mid_way_keeps_none_of_what_it_sent() -> None:
    budget = bodies.BodyBudget(2 * MIB)  # a 4 MiB body overflows it after 2 MiB
    results: list[object] = []
    async with buffering(budget, results) as url, aiohttp.ClientSession() as http:
        async with http.post(url, data=io.BytesIO(b"z" * (4 * MIB))) as resp:
            assert resp.status == 503
    (outcome,) = results
    assert isinstance(outcome, tuple)
    exc, held = outcome
    assert isinstance(exc, bodies.BodyError) and exc.status == 503
    # while the proxy answers (and drains the rest), the error holds at most the one chunk
    # that overflowed, not the 2 MiB that arrived before it
    assert held < MIB, held
    assert budget.used_bytes == 0
