"""What each borrowed job used (vacancyd/control/accounting.py): one ledger row per job when
it ends, energy from the GPU counter shared by time, the per-borrower metrics and quota."""

from __future__ import annotations

import pytest

from vacancyd.control.accounting import Accounting
from vacancyd.control.borrowers import Borrowers
from vacancyd.core.quota import BorrowerLimits, LocalDay
from vacancyd.core.reasons import Reason
from vacancyd.core.usage import UsageRow
from vacancyd.web.metrics import Metrics


class Clocks:
    def __init__(self) -> None:
        self.mono = 100.0
        self.wall = 1_000_000.0 + 100.0

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += s


class Gpu:
    """An energy counter at a constant power (W)."""

    def __init__(self, clocks: Clocks, watts: float | None) -> None:
        self.clocks = clocks
        self.watts = watts

    def energy(self, name: str) -> tuple[float, float] | None:
        if self.watts is None or name != "gpu0":
            return None
        return (self.clocks.mono, self.clocks.mono * self.watts)


def _setup(
    watts: float | None, limits: BorrowerLimits | None = None
) -> tuple[Clocks, Accounting, list[UsageRow], Metrics]:
    clocks = Clocks()
    rows: list[UsageRow] = []
    metrics = Metrics()
    borrowers = Borrowers(
        {"friend": limits or BorrowerLimits()},
        wall=lambda: clocks.wall,
        day=lambda now: LocalDay(1_000_000.0, 1_086_400.0),
    )
    gpu = Gpu(clocks, watts)
    acc = Accounting(
        borrowers,
        metrics,
        record=rows.append,
        energy_of=gpu.energy,
        clock=lambda: clocks.mono,
        wall=lambda: clocks.wall,
    )
    acc.sampled(["gpu0"])
    return clocks, acc, rows, metrics


def test_a_job_without_an_energy_counter_is_written_when_it_ends() -> None:
    clocks, acc, rows, metrics = _setup(None)
    acc.started(1, "friend", "llm", "m", ("gpu0",), clocks.mono)
    clocks.advance(2.5)
    acc.exchanged(1, prompt_tokens=7, completion_tokens=11, bytes_in=100, bytes_out=900)
    acc.ended(1, "completed")
    (row,) = rows
    assert (row.borrower, row.upstream, row.model, row.resource) == ("friend", "llm", "m", "gpu0")
    assert row.ended_at - row.started_at == pytest.approx(2.5)
    assert (row.prompt_tokens, row.completion_tokens) == (7, 11)
    assert (row.bytes_in, row.bytes_out, row.outcome) == (100, 900, "completed")
    assert row.energy_j is None
    assert metrics.borrower_busy.total("friend", "gpu0") == pytest.approx(2.5)
    assert metrics.borrower_tokens.total("friend", "llm", "prompt") == 7
    assert metrics.borrower_tokens.total("friend", "llm", "completion") == 11
    assert ("friend", "gpu0") not in metrics.borrower_energy._sums  # absent, never 0


async def test_energy_waits_for_the_sample_after_the_end_and_is_shared_by_time() -> None:
    clocks, acc, rows, metrics = _setup(100.0)
    acc.started(1, "friend", "llm", None, ("gpu0",), clocks.mono)
    clocks.advance(1)
    acc.started(2, "", "llm", None, ("gpu0",), clocks.mono)
    clocks.advance(1)
    acc.sampled(["gpu0"])
    clocks.advance(1)
    acc.ended(1, "completed")  # ran 3 s: 1 s alone, 2 s beside job 2
    assert rows == []  # its last second is not read yet
    clocks.advance(1)
    acc.sampled(["gpu0"])
    (row,) = rows
    assert row.energy_j == pytest.approx(100 + 200 / 2)
    assert metrics.borrower_energy.total("friend", "gpu0") == pytest.approx(200)
    acc.ended(2, "completed")
    clocks.advance(0.5)
    acc.sampled(["gpu0"])
    assert rows[1].borrower == "" and rows[1].energy_j == pytest.approx(100 + 100)
    assert metrics.borrower_energy.total("default", "gpu0") == pytest.approx(200)


async def test_flush_writes_the_jobs_waiting_for_their_sample() -> None:
    clocks, acc, rows, _ = _setup(100.0)
    acc.started(1, "friend", "llm", None, ("gpu0",), clocks.mono)
    clocks.advance(1)
    acc.ended(1, "cut")
    assert rows == []
    acc.flush()
    (row,) = rows
    assert row.outcome == "cut" and row.energy_j is None  # no reading covered it


def test_busy_time_counts_toward_the_quota_when_the_job_ends() -> None:
    clocks, acc, _rows, _ = _setup(None, BorrowerLimits(daily_busy_s=5, max_concurrent=1))
    acc.started(1, "friend", "llm", None, ("gpu0",), clocks.mono)
    refusal = acc.borrowers.refusal("friend")
    assert refusal is not None and refusal.reason is Reason.BORROWER_BUSY
    clocks.advance(6)
    acc.ended(1, "completed")
    refusal = acc.borrowers.refusal("friend")
    assert refusal is not None and refusal.reason is Reason.QUOTA_EXHAUSTED
    assert acc.borrowers.refusal("") is None
