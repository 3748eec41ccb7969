"""The lender's durable history: samples taken from the store (vacancyd.runtime.history) at
start, every interval and at each presence or lending edge, written to the usage database's
``history`` table off the event loop (vacancyd.runtime.usage), read back oldest first, and
kept for 48 hours within a row bound."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import threading
from pathlib import Path

import pytest

from vacancyd.core import history as history_rules
from vacancyd.core.history import HistorySample, ResourceSample
from vacancyd.core.holds import Hold, HoldKind
from vacancyd.core.ledger import Job
from vacancyd.core.observations import CapacityReading
from vacancyd.core.policy import ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.runtime.history import HistoryRecorder, take_sample
from vacancyd.runtime.usage import USAGE_FILE, LedgerUnreadable, UsageStore
from vacancyd.state import PresenceReading, SharedState

NOW = 1_800_000_000.0
OWNER = PresenceReading(owner_signal=True, evidence_complete=True, detail="owner present")


def sample(at: float, **kw: object) -> HistorySample:
    values: dict[str, object] = {
        "at_wall": at,
        "owner_present": False,
        "lending": True,
        "resources": {"gpu0": ResourceSample(100.0, 1000.0, 50.0)},
        "borrowers": {"alice": 1},
    }
    values.update(kw)
    return HistorySample(**values)  # type: ignore[arg-type]


def usage_store(tmp_path: Path, clock: list[float]) -> UsageStore:
    return UsageStore(tmp_path / USAGE_FILE, retention_days=90, clock=lambda: clock[0])


async def test_samples_are_written_off_the_loop_and_read_back_oldest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [NOW]
    s = usage_store(tmp_path, clock)
    await s.open()
    threads: set[str] = set()
    original = s._insert_history

    def spy(x: HistorySample) -> None:
        threads.add(threading.current_thread().name)
        original(x)

    monkeypatch.setattr(s, "_insert_history", spy)
    try:
        for at in (NOW - 30, NOW - 90, NOW - 60):
            await asyncio.wrap_future(s.record_history(sample(at)))
        assert threads and all(t.startswith("vacancyd-usage") for t in threads)
        got = await s.history(NOW - 75)
        assert [x.at_wall for x in got] == [NOW - 60, NOW - 30]
        assert got[0] == sample(NOW - 60)
        # committed at once: another connection sees every row without a close
        db = sqlite3.connect(s.path)
        assert db.execute("SELECT count(*) FROM history").fetchone()[0] == 3
        db.close()
    finally:
        await s.close()


async def test_history_is_kept_48_hours_and_within_its_row_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [NOW]
    s = usage_store(tmp_path, clock)
    await s.open()
    try:
        for at in (NOW - 49 * 3600, NOW - 47 * 3600, NOW - 60):
            await asyncio.wrap_future(s.record_history(sample(at)))
        await s.prune()
        assert [x.at_wall for x in await s.history(0.0)] == [NOW - 47 * 3600, NOW - 60]
        clock[0] += 3601  # an hour later the second one is past 48 hours too
        await s.prune()
        assert [x.at_wall for x in await s.history(0.0)] == [NOW - 60]

        monkeypatch.setattr(history_rules, "MAX_SAMPLES", 5)
        for i in range(10):
            await asyncio.wrap_future(s.record_history(sample(NOW + i)))
        await s.prune()
        assert [x.at_wall for x in await s.history(0.0)] == [NOW + i for i in range(5, 10)]
    finally:
        await s.close()


async def test_an_unreadable_row_is_skipped_and_a_closed_store_refuses(tmp_path: Path) -> None:
    clock = [NOW]
    s = usage_store(tmp_path, clock)
    await s.open()
    await asyncio.wrap_future(s.record_history(sample(NOW - 10)))
    db = sqlite3.connect(s.path)
    db.execute("INSERT INTO history VALUES (?, 0, 1, 'not json')", (NOW - 5,))
    db.commit()
    db.close()
    assert [x.at_wall for x in await s.history(0.0)] == [NOW - 10]
    await s.close()
    s.record_history(sample(NOW)).result(timeout=1)  # dropped, never raises
    with pytest.raises(LedgerUnreadable):
        await s.history(0.0)


async def test_history_in_a_corrupt_database_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / USAGE_FILE
    path.write_bytes(b"this is not a database" * 100)
    clock = [NOW]
    s = usage_store(tmp_path, clock)
    await s.open()
    try:
        assert s.error is not None and "set aside" in s.error
        await asyncio.wrap_future(s.record_history(sample(NOW)))
        assert [x.at_wall for x in await s.history(0.0)] == [NOW]
    finally:
        await s.close()


# -- taking samples from the store -------------------------------------------------------


def make_state(clock: list[float]) -> SharedState:
    resources = {
        "gpu0": ResourcePolicy("gpu0", ResourceKind.GPU, stale_after_s=5.0),
        "ram": ResourcePolicy("ram", ResourceKind.MEMORY, stale_after_s=5.0),
    }
    upstreams = {"llm": UpstreamPolicy("llm", "openai", "gpu0")}
    return SharedState(
        resources,
        upstreams,
        presence_source="logind",
        release_after_s=60.0,
        clock=lambda: clock[0],
    )


def test_a_sample_reads_presence_lending_gpus_and_jobs() -> None:
    clock = [10.0]
    state = make_state(clock)
    empty = take_sample(state, NOW)
    assert empty == HistorySample(NOW, False, True, {"gpu0": ResourceSample()}, {})

    state.record_capacity(
        "gpu0",
        CapacityReading(free_mib=6000, total_mib=8000, used_mib=None, temperature_c=64.0),
        10.0,
    )
    state.record_capacity("ram", CapacityReading(free_mib=1, total_mib=2), 10.0)
    state.record_presence(OWNER, 10.0)
    job = state.ledger.reserve("llm", ("gpu0",), 10.0)
    assert isinstance(job, Job)
    got = take_sample(state, NOW)
    assert got.owner_present and got.lending
    assert got.resources == {"gpu0": ResourceSample(2000.0, 8000.0, 64.0)}  # no "ram"
    assert got.borrowers == {"": 1}  # a job nobody named: the unnamed borrower
    live = {job.id: "alice"}  # the job's record names its borrower
    assert take_sample(state, NOW, borrowers=live).borrowers == {"alice": 1}
    # jobs that started since the last sample count too (once, when still running)
    since = {job.id: "alice", 98: "bob", 99: ""}
    got = take_sample(state, NOW, since_last=since, borrowers=live)
    assert got.borrowers == {"alice": 1, "bob": 1, "": 1}

    state.holds = (Hold(HoldKind.PAUSE, "paused by the owner"),)
    assert not take_sample(state, NOW).lending
    state.holds = (Hold(HoldKind.EXCLUSIVE_APP, "game", resources=frozenset({"gpu0"})),)
    assert take_sample(state, NOW).lending  # a hold on one card does not stop lending
    state.holds = ()
    state.set_lending(False)
    assert not take_sample(state, NOW).lending
    # a reading that went unknown (the probe failed) is not drawn as the old value
    state.record_capacity_failure("gpu0", "GPU lost", 11.0)
    assert take_sample(state, NOW, 11.0).resources == {"gpu0": ResourceSample()}


class Collect:
    def __init__(self) -> None:
        self.samples: list[HistorySample] = []
        self.fail = False

    def record_history(self, s: HistorySample) -> concurrent.futures.Future[None]:
        if self.fail:
            raise OSError("disk on fire")
        self.samples.append(s)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done

    async def history(self, since: float) -> list[HistorySample]:
        return [s for s in self.samples if s.at_wall >= since]


async def test_the_recorder_samples_at_start_each_interval_and_each_edge() -> None:
    loop = asyncio.get_running_loop()
    state = SharedState(
        {"gpu0": ResourcePolicy("gpu0", ResourceKind.GPU)},
        {},
        presence_source="logind",
        clock=loop.time,
    )
    out = Collect()
    walls = iter(range(1000, 2000))
    live: dict[int, str] = {}  # the live jobs' borrowers, as Work.borrowers reads them
    rec = HistoryRecorder(
        state,
        out,
        interval_s=0.3,
        wall_clock=lambda: float(next(walls)),
        borrowers=lambda: live,
    )
    task = asyncio.create_task(rec.run())
    try:
        await asyncio.sleep(0.05)
        assert len(out.samples) == 1 and out.samples[0].lending  # at start
        await asyncio.sleep(0.4)
        assert len(out.samples) == 2  # one interval later
        # a burst of edges right after a sample: one sample, after the minimum gap
        for enabled in (False, True, False):
            state.set_lending(enabled)
        await asyncio.sleep(0.05)
        assert len(out.samples) == 2
        await asyncio.sleep(history_rules.MIN_GAP_S)
        assert len(out.samples) == 3 and not out.samples[-1].lending
        # a failing store is logged, and the recorder goes on
        out.fail = True
        state.set_lending(True)
        await asyncio.sleep(history_rules.MIN_GAP_S + 0.1)
        assert not task.done()
        out.fail = False
        await asyncio.sleep(0.4)
        assert out.samples[-1].lending
        # a job that starts and ends between two samples is in the next one
        before = len(out.samples)
        live[7] = "alice"
        state.note_job(7, "llm", "alice", "tiny")
        del live[7]
        state.note_job(7, "llm", "alice", "tiny", outcome="completed")
        await asyncio.sleep(0.7)
        assert len(out.samples) >= before + 2
        assert out.samples[before].borrowers == {"alice": 1}
        assert out.samples[-1].borrowers == {}  # and only in that one
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not state.events  # unsubscribed when it ends
