"""vacancyd.control.upstreamcalls: every call to a server's own API has a deadline, a typed
outcome, its metrics and one log line, whatever the controller does."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import generate_latest

import vacancyd.control.upstreamcalls as calls_module
from vacancyd.adapters.base import UpstreamError
from vacancyd.control.upstreamcalls import Call, Outcome, Status, UpstreamCalls
from vacancyd.core.classify import Route
from vacancyd.web.metrics import Metrics


class Server:
    """A controller whose unload answers ``said`` (or raises ``error``, or hangs)."""

    can_cancel = True

    def __init__(
        self, said: str = "unloaded", error: str | None = None, hang: bool = False
    ) -> None:
        self.said = said
        self.error = error
        self.hang = hang
        self.asleep = False

    async def _answer(self, detail: str) -> str:
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise UpstreamError(self.error)
        return detail

    def prepare(self, route: Route, body: bytes) -> tuple[bytes, str | None]:
        return body, None

    def allows_result(self, route: Route, path: str) -> bool:
        return True

    async def wait_done(self, key: str) -> None:
        return None

    async def cancel(self, keys: list[str]) -> str:
        return await self._answer(f"cancelled {len(keys)}")

    async def unload(self, admitted: frozenset[str]) -> tuple[str, str]:
        return self.said, await self._answer("models gone")

    async def warm(self, model: str) -> str:
        return await self._answer(f"{model} loaded")

    async def resident(self) -> list[str] | None:
        await self._answer("")
        return ["tiny"]


class Sleeper(Server):
    async def ensure_awake(self) -> float | None:
        await self._answer("")
        if not self.asleep:
            return None
        self.asleep = False
        return 0.5


def scrape(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def made(metrics: Metrics, upstream: str, call: str, outcome: str) -> float:
    line = (
        f'vacancyd_upstream_calls_total{{call="{call}",outcome="{outcome}",upstream="{upstream}"}} '
    )
    for row in scrape(metrics).splitlines():
        if row.startswith(line):
            return float(row.removeprefix(line))
    return 0.0


async def test_a_done_unload_is_timed_counted_and_logged_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "vacancyd.control.upstreamcalls")
    metrics = Metrics()
    calls = UpstreamCalls(metrics)
    calls.add("up", Server())
    outcome = await calls.unload("up", frozenset(), why="reclaim")
    assert (outcome.call, outcome.status, outcome.detail) == (
        Call.UNLOAD,
        Status.DONE,
        "models gone",
    )
    assert outcome.done and outcome.elapsed_s >= 0
    assert made(metrics, "up", "unload", "done") == 1
    text = scrape(metrics)
    assert 'vacancyd_unload_duration_seconds_count{outcome="unloaded",upstream="up"} 1.0' in text
    assert [r.getMessage() for r in caplog.records] == [
        f"reclaim: unloaded up in {outcome.elapsed_s:.2f} s: models gone"
    ]


@pytest.mark.parametrize(
    ("server", "status", "label"),
    [
        (Server(said="skipped"), Status.SKIPPED, "skipped"),
        (Server(error="connection refused"), Status.FAILED, "failed"),
        (Server(hang=True), Status.TIMED_OUT, "timed_out"),
    ],
    ids=["skipped", "failed", "timed_out"],
)
async def test_an_unload_that_is_not_done_says_how_and_never_raises(
    server: Server,
    status: Status,
    label: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(calls_module, "UNLOAD_DEADLINE_S", 0.05)
    caplog.set_level(logging.INFO, "vacancyd.control.upstreamcalls")
    metrics = Metrics()
    calls = UpstreamCalls(metrics)
    calls.add("up", server)
    outcome = await asyncio.wait_for(calls.unload("up", frozenset(), why="reclaim"), 5)
    assert outcome.status is status and not outcome.done
    assert made(metrics, "up", "unload", label) == 1
    assert f'vacancyd_unload_duration_seconds_count{{outcome="{label}",upstream="up"}} 1.0' in (
        scrape(metrics)
    )
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(f"reclaim: unload of up {label} after ")
    if status is Status.TIMED_OUT:
        assert outcome.detail == "no answer within 0.05 s"


async def test_no_controller_is_not_supported_and_nothing_is_sent_or_counted() -> None:
    metrics = Metrics()
    calls = UpstreamCalls(metrics)
    for outcome in (
        await calls.unload("up", frozenset(), why="reclaim"),
        await calls.warm("up", "tiny", why="warm"),
        await calls.cancel("up", ["k"], why="reclaim"),
        await calls.wake("up", why="borrowed request"),
    ):
        assert outcome.status is Status.NOT_SUPPORTED
    assert not calls.supports("up") and not calls.waker("up")
    assert "vacancyd_upstream_calls_total{" not in scrape(metrics)
    assert "vacancyd_unload_duration_seconds_count{" not in scrape(metrics)


async def test_a_cancel_counts_each_queued_job_it_cancelled() -> None:
    metrics = Metrics()
    calls = UpstreamCalls(metrics)
    calls.add("comfy", Server())
    outcome = await calls.cancel("comfy", ["a", "b"], why="reclaim on comfy")
    assert outcome.done and outcome.detail == "cancelled 2"
    assert 'vacancyd_reclaim_cancelled_jobs_total{kind="queued",upstream="comfy"} 2.0' in (
        scrape(metrics)
    )
    calls.add("broken", Server(error="boom"))
    failed = await calls.cancel("broken", ["c"], why="reclaim on broken")
    assert failed.status is Status.FAILED and failed.detail == "boom"
    assert 'kind="queued",upstream="broken"' not in scrape(metrics)


async def test_residency_reads_carry_their_value() -> None:
    calls = UpstreamCalls(Metrics())
    calls.add("ollama", Server())
    read = await calls.resident("ollama", why="exclusive job of comfy")
    assert read.done and read.value == ["tiny"]
    calls.add("down", Server(error="refused"))
    failed = await calls.resident("down", why="exclusive job of comfy")
    assert failed.status is Status.FAILED and failed.value is None


async def test_a_wake_is_measured_only_when_the_server_slept() -> None:
    metrics = Metrics()
    calls = UpstreamCalls(metrics)
    server = Sleeper()
    calls.add("vllm", server)
    assert calls.waker("vllm")
    awake = await calls.wake("vllm", why="borrowed request")
    assert awake.done and awake.value is None
    assert "vacancyd_wake_duration_seconds_count{" not in scrape(metrics)
    server.asleep = True
    woken = await calls.wake("vllm", why="borrowed request")
    assert woken.done and woken.value == 0.5
    assert made(metrics, "vllm", "wake", "done") == 1
    assert 'vacancyd_wake_duration_seconds_count{outcome="woken",upstream="vllm"} 1.0' in (
        scrape(metrics)
    )
    server.error = "POST /wake_up answered 500"
    failed = await calls.wake("vllm", why="borrowed request")
    assert failed.status is Status.FAILED and failed.detail == "POST /wake_up answered 500"
    assert 'vacancyd_wake_duration_seconds_count{outcome="failed",upstream="vllm"} 1.0' in (
        scrape(metrics)
    )


def test_the_log_line_names_what_the_call_was_for() -> None:
    warm: Outcome[None] = Outcome(Call.WARM, "up", Status.DONE, "loaded", 1.234)
    assert (
        warm.line("warm reload", "'tiny' on up")
        == "warm reload: warmed 'tiny' on up in 1.23 s: loaded"
    )
    gone: Outcome[None] = Outcome(Call.FREE, "comfy", Status.NOT_SUPPORTED, "no unload API")
    assert gone.line("after the exclusive job") == (
        "after the exclusive job: free of comfy not_supported: no unload API"
    )
