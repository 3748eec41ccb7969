"""The usage ledger's cost per finished job (vacancyd.runtime.usage).

Not a timed test: run it by hand and copy the figures into docs/benchmarks.md.

    .venv/bin/python bench/usage_ledger.py [--rows N] [--history N]

In a temporary directory it measures, with the store as the daemon runs it (WAL,
synchronous=NORMAL, one commit per row, on the store's own thread):

* what recording a row costs the event loop: the time ``UsageStore.record`` takes on the
  loop (it only hands the row to the store's thread), per call;
* how long a row takes to be committed, one at a time (record -> its future done), p50/p99;
* a burst of N rows recorded at once: rows committed per second, and the event loop's
  largest lag meanwhile (a 1 ms ticker on the loop);
* the CPU time per committed row (process user + system time, every thread);
* ``vacancyd usage`` queries over a ledger of ``--history`` rows (default 100,000: about 90
  days of a busy lender): by borrower, by day, by model, offline (read-only) and through the
  store;
* ``--proxy N``: the ledger's cost per job side by side with the proxy without it. One real
  daemon (in this process, the test suite's ``running_daemon``) in front of a canned
  OpenAI-shaped upstream that reports ``usage``, N back-to-back chat completions over one
  kept-alive connection, in blocks that alternate between the job accounting on (tokens read
  from the reply, the quota counts, the metrics, one ledger row committed per job) and off
  (``Work.accounting`` None: what the proxy did before). Prints per mode the p50/p99
  request latency and the process CPU per request, and the ratios on/off.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vacancyd.core.usage import UsageRow
from vacancyd.runtime.usage import USAGE_FILE, UsageStore, read_groups

BORROWERS = ("", "friend", "litellm", "cluster")
MODELS = ("qwen2.5-7b-instruct", "llama-3.1-8b-instruct", None)


def row(i: int, now: float, spread_s: float = 3600.0) -> UsageRow:
    end = now - random.uniform(0, spread_s)
    return UsageRow(
        job_id=i,
        borrower=BORROWERS[i % len(BORROWERS)],
        upstream="llama",
        model=MODELS[i % len(MODELS)],
        resource="gpu0",
        started_at=end - random.uniform(1, 60),
        ended_at=end,
        outcome="completed",
        prompt_tokens=random.randint(10, 4000),
        completion_tokens=random.randint(1, 1000),
        energy_j=random.uniform(100, 20000),
        bytes_in=random.randint(200, 20000),
        bytes_out=random.randint(200, 200000),
    )


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(0.001)
        lags.append(loop.time() - before - 0.001)


async def main(rows: int, history: int) -> None:
    now = time.time()
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-usage-") as scratch:
        path = Path(scratch) / USAGE_FILE
        store = UsageStore(path, retention_days=90)
        await store.open()

        on_loop: list[float] = []
        commit: list[float] = []
        for i in range(500):
            r = row(i, now)
            t0 = time.perf_counter()
            fut = store.record(r)
            on_loop.append(time.perf_counter() - t0)
            await asyncio.wrap_future(fut)
            commit.append(time.perf_counter() - t0)
        print(
            f"record() on the loop: p50 {pct(on_loop, 0.5) * 1e6:.1f} us, "
            f"p99 {pct(on_loop, 0.99) * 1e6:.1f} us"
        )
        print(
            f"committed, one at a time: p50 {pct(commit, 0.5) * 1e3:.2f} ms, "
            f"p99 {pct(commit, 0.99) * 1e3:.2f} ms"
        )

        lags: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(lags, stop))
        await asyncio.sleep(0.05)
        burst = [row(1000 + i, now) for i in range(rows)]
        cpu0, t0 = cpu_s(), time.perf_counter()
        futures = []
        for i, r in enumerate(burst):
            futures.append(store.record(r))
            if i % 20 == 19:
                await asyncio.sleep(0)  # jobs end in the loop's own turns, not all in one
        submitted = time.perf_counter() - t0
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        wall, cpu = time.perf_counter() - t0, cpu_s() - cpu0
        stop.set()
        await tick
        print(
            f"burst of {rows:,} rows: handed over in {submitted * 1e3:.1f} ms, committed in "
            f"{wall:.2f} s ({rows / wall:,.0f} rows/s), {cpu / rows * 1e6:.0f} us CPU per row; "
            f"loop lag meanwhile p50 {statistics.median(lags) * 1e3:.2f} ms, "
            f"max {max(lags) * 1e3:.1f} ms"
        )

        # a ledger of `history` rows over 90 days, written in one transaction
        def fill() -> None:
            import sqlite3

            db = sqlite3.connect(path)
            with db:
                db.executemany(
                    "INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        dataclasses.astuple(row(10_000_000 + i, now, 90 * 86400.0))
                        for i in range(history)
                    ),
                )
            db.close()

        await asyncio.to_thread(fill)
        for by in ("borrower", "day", "model"):
            t0 = time.perf_counter()
            groups = await store.groups(now - 90 * 86400.0, by)
            through_store = time.perf_counter() - t0
            t0 = time.perf_counter()
            read_groups(path, now - 90 * 86400.0, by)
            offline = time.perf_counter() - t0
            print(
                f"query by {by} over {history:,} rows ({len(groups)} groups): "
                f"store {through_store * 1e3:.0f} ms, offline {offline * 1e3:.0f} ms"
            )
        await store.close()
        print(f"ledger size: {path.stat().st_size / 1e6:.1f} MB")


async def proxy_side_by_side(requests: int, block: int = 50) -> None:
    """The proxy with and without the job accounting, interleaved in blocks (module doc)."""
    import json

    import aiohttp
    from aiohttp import web

    from tests.support.config import daemon_toml, upstream
    from tests.support.daemon import running_daemon, serve_app

    usage = {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46}
    reply = json.dumps(
        {"id": "c", "object": "chat.completion", "choices": [], "usage": usage}
    ).encode()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=reply, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    with tempfile.TemporaryDirectory(prefix="vacancyd-bench-ledger-proxy-") as scratch:
        async with serve_app(app) as url:
            toml = daemon_toml(upstream("llm", url), state_dir=scratch)
            async with running_daemon(toml) as d:
                await d.wait_ready()
                work = d.daemon.work
                accounting = work.accounting
                modes = {"ledger on": accounting, "ledger off": None}
                lat: dict[str, list[float]] = {m: [] for m in modes}
                cpu: dict[str, float] = dict.fromkeys(modes, 0.0)
                target = d.proxy_url("llm") + "/v1/chat/completions"
                headers = {"Content-Type": "application/json"}
                async with aiohttp.ClientSession() as http:
                    for _ in range(20):  # warm up
                        async with http.post(target, data=body, headers=headers) as r:
                            await r.read()
                    done = 0
                    turn = 0
                    while done < requests:
                        order = list(modes) if turn % 2 == 0 else list(reversed(modes))
                        turn += 1
                        for mode in order:
                            work.accounting = modes[mode]
                            c0 = cpu_s()
                            for _ in range(block):
                                t0 = time.perf_counter()
                                async with http.post(target, data=body, headers=headers) as r:
                                    await r.read()
                                    assert r.status == 200, r.status
                                lat[mode].append(time.perf_counter() - t0)
                            cpu[mode] += cpu_s() - c0
                        done += block
                work.accounting = accounting
    for mode in modes:
        n = len(lat[mode])
        print(
            f"{mode}: {n} requests, p50 {pct(lat[mode], 0.5) * 1e6:.0f} us, "
            f"p99 {pct(lat[mode], 0.99) * 1e6:.0f} us, {cpu[mode] / n * 1e6:.0f} us CPU/request"
        )
    on, off = lat["ledger on"], lat["ledger off"]
    print(
        f"ratio on/off: p50 {pct(on, 0.5) / pct(off, 0.5):.3f}, "
        f"p99 {pct(on, 0.99) / pct(off, 0.99):.3f}, "
        f"CPU/request {cpu['ledger on'] / cpu['ledger off']:.3f} "
        "(client, proxy, upstream and the ledger's thread share this process)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--history", type=int, default=100_000)
    parser.add_argument("--proxy", type=int, default=0, metavar="N", help="proxy side by side")
    args = parser.parse_args()
    random.seed(23)
    if args.proxy:
        asyncio.run(proxy_side_by_side(args.proxy))
    else:
        asyncio.run(main(args.rows, args.history))
