"""Owner-return latency: from logind announcing an unlock to vacancyd refusing borrowed work.

Runs a private dbus-daemon, the logind look-alike from ``tests/support/fake_logind.py`` on its
own thread and event loop (as logind is its own process), a fake OpenAI-shaped upstream and an
in-process vacancyd with ``presence = "logind"`` pointed at the private bus. Each trial:

1. the owner's wayland session is locked and vacancyd admits a borrowed request (200);
2. after a random pause, the look-alike sets ``LockedHint = false`` and emits
   ``PropertiesChanged`` (what logind does when the desktop calls ``SetLockedHint(false)``);
   ``t0`` is taken on the look-alike's thread just before the emit;
3. a borrower sends requests back to back; the delay is ``t1 - t0`` where ``t1`` is when the
   first ``503 owner_active`` arrives. The time the veto engaged inside vacancyd is recorded
   too.

Two modes: with signals (``signals = true``, polling every 3 s as the backstop) and polling
only (``signals = false``, ``poll_s`` as given). Usage::

    .venv/bin/python bench/presence_latency.py --trials 300 --poll-trials 60 --poll-s 1.0

Prints p50/p90/p99/max per mode. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.dbus import private_bus
from tests.support.fake_logind import FakeLogind, SessionSpec
from vacancyd.core.events import VetoChanged

T = TypeVar("T")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


class LogindThread:
    """The look-alike on its own thread and loop."""

    def __init__(self, address: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fake: FakeLogind = self.run(FakeLogind.start(address, [SessionSpec("1", locked=True)]))

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def call(self, fn: Callable[[], T]) -> T:
        done: Future[T] = Future()

        def go() -> None:
            try:
                done.set_result(fn())
            except Exception as exc:
                done.set_exception(exc)

        self.loop.call_soon_threadsafe(go)
        return done.result(10)

    def set_locked(self, locked: bool) -> float:
        """Emit the change on the look-alike's thread; returns perf_counter just before it."""

        def emit() -> float:
            t0 = time.perf_counter()
            self.fake.session("1").set_locked(locked)
            return t0

        return self.call(emit)

    def close(self) -> None:
        self.run(self.fake.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def config(address: str, target: str, *, signals: bool, poll_s: float) -> str:
    return f"""
[server]
listen = "127.0.0.1:0"
trust_loopback = true

[owner]
presence = "logind"
bus_address = "{address}"
release_after_s = 0
signals = {"true" if signals else "false"}

[collectors]
poll_s = {poll_s}
probe_timeout_s = 2.0

[[resource]]
name = "ram"
kind = "memory"

[[upstream]]
name = "llm"
adapter = "openai"
listen = "127.0.0.1:0"
target = "{target}"
resource = "ram"
"""


async def run_mode(
    address: str, logind: LogindThread, *, signals: bool, poll_s: float, trials: int
) -> dict[str, list[float]]:
    app, _ = openai_like_app()
    refused_ms: list[float] = []
    veto_ms: list[float] = []
    async with serve_app(app) as target:
        async with running_daemon(config(address, target, signals=signals, poll_s=poll_s)) as d:
            state = d.state
            engaged_at: list[float] = []
            state.subscribe(
                lambda e: (
                    engaged_at.append(time.perf_counter())
                    if isinstance(e, VetoChanged) and e.active
                    else None
                )
            )
            url = f"{d.proxy_url('llm')}/v1/chat/completions"
            async with aiohttp.ClientSession() as http:
                await d.wait_ready(30)
                for _ in range(trials):
                    # Owner away again: lock, then wait until a borrowed request is admitted
                    # (the post-job capacity rule may answer resource_busy first).
                    await asyncio.to_thread(logind.set_locked, True)
                    deadline = time.monotonic() + poll_s * 3 + 10
                    while True:
                        async with http.post(url, json=CHAT) as resp:
                            await resp.read()
                            if resp.status == 200:
                                break
                        if time.monotonic() > deadline:
                            raise RuntimeError("vacancyd did not admit work after the lock")
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(random.uniform(0.0, poll_s if not signals else 0.05))
                    engaged_at.clear()
                    t0 = await asyncio.to_thread(logind.set_locked, False)
                    while True:
                        async with http.post(url, json=CHAT) as resp:
                            body = await resp.read()
                            # Other answers (an admission before the veto, or the
                            # post-job capacity rule's resource_busy) are "not refused yet".
                            if resp.status == 503 and b'"owner_active"' in body:
                                t1 = time.perf_counter()
                                break
                    refused_ms.append((t1 - t0) * 1000)
                    if engaged_at:
                        veto_ms.append((engaged_at[0] - t0) * 1000)
    return {"refused_ms": refused_ms, "veto_ms": veto_ms}


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]

    return {
        "n": len(ordered),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, private_bus(Path(tmp)) as bus:
        logind = LogindThread(bus.address)
        try:
            modes = [
                ("signals", True, 3.0, args.trials),
                ("polling", False, args.poll_s, args.poll_trials),
            ]
            for name, signals, poll_s, trials in modes:
                if trials <= 0:
                    continue
                raw = await run_mode(
                    bus.address, logind, signals=signals, poll_s=poll_s, trials=trials
                )
                results[name] = {
                    "poll_s": poll_s,
                    "refused_ms": summary(raw["refused_ms"]),
                    "veto_ms": summary(raw["veto_ms"]) if raw["veto_ms"] else None,
                }
        finally:
            logind.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=300, help="trials with signals")
    parser.add_argument("--poll-trials", type=int, default=60, help="trials polling only")
    parser.add_argument("--poll-s", type=float, default=1.0, help="poll interval, polling only")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for mode, r in results.items():
        ref = r["refused_ms"]
        print(
            f"{mode:8} (poll {r['poll_s']:g} s): unlock -> first refusal "
            f"n={ref['n']} p50={ref['p50']:.2f} ms p90={ref['p90']:.2f} ms "
            f"p99={ref['p99']:.2f} ms max={ref['max']:.2f} ms"
        )
        if r["veto_ms"]:
            v = r["veto_ms"]
            print(f"{'':8}  unlock -> veto engaged  p50={v['p50']:.2f} ms p99={v['p99']:.2f} ms")


if __name__ == "__main__":
    main()
