"""Admission under contention: N clients on an upstream with M slots (sharing issue, "Measure").

Two parts, one run:

1. **Through the proxy.** An in-process daemon in front of an upstream that answers each
   chat completion after ``--service-ms``; ``--clients`` borrowers send ``--requests`` requests
   back to back, once with ``busy = "refuse"`` and once with ``busy = "wait"``, both with
   ``max_concurrent = --slots``. Reports admitted / refused / waited counts (from vacancyd's
   own ``vacancyd_wait_seconds`` histogram) and the borrowers' latency p50/p99. The anchor is
   the upstream's own service time: ``latency / service`` says what contention costs.
2. **The cost of one admission as the queue grows.** The same ``Work`` the proxy uses,
   without sockets: every slot is taken, ``L`` requests wait, and each step releases one job
   and lands the capacity sample that must follow a release, which admits the queue's head
   (the step also refills the queue, so it stays at ``L``). The time per admitted job is
   compared with the same step at ``L = 0`` (a direct admission), as a ratio: it must stay flat.

Usage::

    .venv/bin/python bench/admission_contention.py [--clients 32] [--slots 4] [--requests 400]

Not a test: figures depend on the machine. Prints a JSON summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.daemon import running_daemon, serve_app
from vacancyd.api.metrics import Metrics
from vacancyd.config import parse_config
from vacancyd.control.admission import Admission, Admitted
from vacancyd.control.upstreamcalls import UpstreamCalls
from vacancyd.control.work import Work
from vacancyd.core.lifecycle import JobState
from vacancyd.core.observations import CapacityReading
from vacancyd.core.snapshot import RequestFacts
from vacancyd.runtime.daemon import build_state
from vacancyd.runtime.tasks import Supervisor

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def config(target: str, sharing: str) -> str:
    return f"""
[server]
listen = "127.0.0.1:0"
trust_loopback = true
[server.limits]
max_connections = 4096
[owner]
presence = "headless"
[collectors]
poll_s = 0.5
[[resource]]
name = "ram"
kind = "memory"
[[upstream]]
name = "up"
adapter = "openai"
listen = "127.0.0.1:0"
target = "{target}"
resource = "ram"
{sharing}
"""


def upstream_app(service_s: float) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(service_s)
        return web.json_response(
            {"id": "c", "object": "chat.completion", "choices": [{"index": 0}]}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def through_proxy(args: argparse.Namespace, busy: str) -> dict[str, Any]:
    sharing = f'max_concurrent = {args.slots}\nbusy = "{busy}"'
    if busy == "wait":
        sharing += f"\nwait_timeout_s = 120\nmax_waiting = {args.clients}"
    service_s = args.service_ms / 1000
    async with (
        serve_app(upstream_app(service_s)) as url,
        running_daemon(config(url, sharing)) as d,
    ):
        await d.wait_ready()
        statuses: list[int] = []
        latencies: list[float] = []
        left = args.requests
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as client:

            async def borrower() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    started = time.perf_counter()
                    async with client.post(
                        d.proxy_url("up") + "/v1/chat/completions", json=CHAT
                    ) as r:
                        await r.read()
                        statuses.append(r.status)
                    if r.status == 200:
                        latencies.append(time.perf_counter() - started)

            started = time.perf_counter()
            await asyncio.gather(*(borrower() for _ in range(args.clients)))
            elapsed = time.perf_counter() - started
        registry = d.daemon.metrics.registry

        def waits(outcome: str) -> float:
            value = registry.get_sample_value(
                "vacancyd_wait_seconds_count", {"upstream": "up", "outcome": outcome}
            )
            return value or 0.0

    admitted = statuses.count(200)
    return {
        "busy": busy,
        "admitted": admitted,
        "refused": len(statuses) - admitted,
        "waited": int(sum(waits(o) for o in ("admitted", "refused", "timeout"))),
        "latency_p50_ms": round(pct(latencies, 0.5) * 1000, 2),
        "latency_p99_ms": round(pct(latencies, 0.99) * 1000, 2),
        "latency_p50_over_service": round(pct(latencies, 0.5) / service_s, 2),
        "throughput_per_s": round(admitted / elapsed, 1),
    }


DECISIONS = [0]


def count_decisions() -> None:
    """Count the gate's decisions made by admission (``Admission`` calls ``gate.decide``)."""
    from vacancyd.core import gate  # admission calls it through the module

    real = gate.decide

    def counted(*args: Any, **kw: Any) -> Any:
        DECISIONS[0] += 1
        return real(*args, **kw)

    gate.decide = counted


async def admission_cost(slots: int, queue: int, steps: int) -> tuple[float, float]:
    """(microseconds, gate decisions) per admitted job with ``queue`` requests waiting and
    every slot taken."""
    settings = parse_config(
        config(
            "http://127.0.0.1:9",
            f'max_concurrent = {slots}\nbusy = "wait"\n'
            f"max_waiting = {queue + 1}\nwait_timeout_s = 3600",
        ),
        "<bench>",
    )
    state = build_state(settings)
    clock = [1000.0]
    state.clock = lambda: clock[0]
    metrics = Metrics()
    work = Work(state, supervisor=Supervisor(), metrics=metrics, calls=UpstreamCalls(metrics))
    admission = Admission(state, work)
    up = settings.upstream[0]
    work.enable_wait("up", max_waiting=up.waiting_limit, timeout_s=up.wait_timeout)
    reading = CapacityReading(64_000, 128_000, 0.1)
    state.presence_max_age_s = 1e9
    from vacancyd.state import PresenceReading

    state.record_presence(PresenceReading(False, True), clock[0])
    facts = RequestFacts(model="tiny")

    def sample() -> None:
        clock[0] += 0.001
        state.record_capacity("ram", reading, clock[0])

    sample()
    running: list[JobState] = []
    for _ in range(slots):
        admitted = await admission.admit("up", facts)
        assert isinstance(admitted, Admitted), admitted
        running.append(admitted.job.admitted)
    queued: asyncio.Queue[JobState] = asyncio.Queue()

    async def waiter() -> None:
        outcome = await admission.admit("up", facts)
        assert isinstance(outcome, Admitted), outcome
        queued.put_nowait(outcome.job.admitted)

    tasks = [asyncio.create_task(waiter()) for _ in range(queue)]
    await asyncio.sleep(0)
    assert work.rooms.waiting("up") == queue
    gc.disable()
    total = 0.0
    DECISIONS[0] = 0
    for _ in range(steps):
        if queue:
            tasks.append(asyncio.create_task(waiter()))
            await asyncio.sleep(0)  # the refill joins the queue behind the others
        victim = running.pop(0)
        t0 = time.perf_counter()
        work._release_now(victim.id)
        sample()  # the post-release sample serves the queue: the head is admitted
        if not queue:
            job = admission._attempt("up", facts)
            assert isinstance(job, JobState), job
            running.append(job)
        total += time.perf_counter() - t0
        if queue:
            running.append(await queued.get())
    gc.enable()
    decisions = DECISIONS[0] / steps
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return total / steps * 1e6, decisions


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--service-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    rows = [await through_proxy(args, "refuse"), await through_proxy(args, "wait")]
    for row in rows:
        print(json.dumps(row))
    # Rounds interleave the queue lengths so machine noise hits them alike; medians win.
    count_decisions()
    sizes = (0, 10, 100, 1000)
    samples: dict[int, list[float]] = {q: [] for q in sizes}
    decisions: dict[int, float] = {}
    for _ in range(args.rounds):
        for queue in sizes:
            us, decisions[queue] = await admission_cost(args.slots, queue, args.steps)
            samples[queue].append(us)
    costs = {q: statistics.median(v) for q, v in samples.items()}
    for queue in sizes:
        print(
            f"queue {queue:5d}: {costs[queue]:8.1f} us per admission "
            f"(ratio to an empty queue {costs[queue] / costs[0]:.2f}), "
            f"{decisions[queue]:.2f} gate decisions per admission"
        )
    print(
        json.dumps(
            {
                "clients": args.clients,
                "slots": args.slots,
                "requests": args.requests,
                "service_ms": args.service_ms,
                "proxy": rows,
                "admission_us_by_queue": {str(k): round(v, 1) for k, v in costs.items()},
                "ratio_to_empty_queue": {str(k): round(v / costs[0], 2) for k, v in costs.items()},
                "gate_decisions_per_admission": {str(k): v for k, v in decisions.items()},
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
