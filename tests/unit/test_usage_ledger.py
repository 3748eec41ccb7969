"""The durable usage ledger (vacancyd.runtime.usage): WAL, one commit per row, retention,
a corrupt database set aside, every call off the event loop, and the grouped queries."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from vacancyd.core.usage import UsageGroup, UsageRow, parse_since
from vacancyd.runtime.usage import (
    USAGE_FILE,
    LedgerUnreadable,
    UsageStore,
    read_groups,
    since_wall,
)

NOW = 1_800_000_000.0  # a fixed wall time


def row(job_id: int, **kw: object) -> UsageRow:
    values: dict[str, object] = {
        "job_id": job_id,
        "borrower": "friend",
        "upstream": "llama",
        "model": "qwen",
        "resource": "gpu0",
        "started_at": NOW - 100,
        "ended_at": NOW - 90,
        "outcome": "completed",
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "energy_j": 500.0,
        "bytes_in": 100,
        "bytes_out": 2000,
    }
    values.update(kw)
    return UsageRow(**values)  # type: ignore[arg-type]


def store(tmp_path: Path, clock: list[float] | None = None, **kw: float) -> UsageStore:
    now = clock if clock is not None else [NOW]
    return UsageStore(
        tmp_path / USAGE_FILE, retention_days=kw.pop("retention_days", 90), clock=lambda: now[0]
    )


def matching(directory: Path, pattern: str) -> list[Path]:
    return sorted(directory.glob(pattern))


def rows_on_disk(path: Path) -> list[tuple[object, ...]]:
    db = sqlite3.connect(path)
    try:
        return list(db.execute("SELECT job_id, borrower, outcome FROM jobs ORDER BY job_id"))
    finally:
        db.close()


async def test_a_recorded_row_is_committed_at_once_in_a_wal_database(tmp_path: Path) -> None:
    s = store(tmp_path)
    await s.open()
    try:
        await asyncio.wrap_future(s.record(row(1)))
        # another connection (another process, after a kill -9) sees it without a close
        assert rows_on_disk(s.path) == [(1, "friend", "completed")]
        db = sqlite3.connect(s.path)
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        db.close()
        assert s.error is None
    finally:
        await s.close()


async def test_rows_recorded_while_the_thread_is_busy_are_committed_together(
    tmp_path: Path,
) -> None:
    """Jobs that end while the store's thread is still writing are taken in one transaction
    (one commit for the burst), and every one of them is on disk when its future is done."""
    s = store(tmp_path)
    await s.open()
    busy = threading.Event()
    blocker = s._executor.submit(busy.wait)  # the thread is busy with an earlier write
    try:
        futures = [s.record(row(i)) for i in range(1, 51)]
        assert all(f is futures[0] for f in futures), "one pending write takes the burst"
        assert not futures[0].done()
        busy.set()
        await asyncio.wrap_future(futures[0])
        assert [r[0] for r in rows_on_disk(s.path)] == list(range(1, 51))
        later = s.record(row(51))
        assert later is not futures[0], "a row after the write is taken by a new one"
        await asyncio.wrap_future(later)
        assert len(rows_on_disk(s.path)) == 51
        assert s.error is None
    finally:
        busy.set()
        blocker.result()
        await s.close()


async def test_a_failing_batch_is_written_row_by_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A row the database refuses (NOT NULL broken) fails the transaction of its burst; the
    other rows are still written one by one, and only the bad one is dropped, named."""
    s = store(tmp_path)
    await s.open()
    busy = threading.Event()
    blocker = s._executor.submit(busy.wait)
    try:
        futures = [s.record(row(2)), s.record(row(9, borrower=None)), s.record(row(3))]
        busy.set()
        await asyncio.wrap_future(futures[-1])
        assert [r[0] for r in rows_on_disk(s.path)] == [2, 3]
        assert s.dropped == 1
        assert "could not record job 9" in caplog.text
        assert s.error is None, "the rows written after it clear the error"
    finally:
        busy.set()
        blocker.result()
        await s.close()


async def test_every_column_round_trips_and_nulls_stay_null(tmp_path: Path) -> None:
    s = store(tmp_path)
    await s.open()
    await asyncio.wrap_future(
        s.record(row(7, model=None, prompt_tokens=None, completion_tokens=None, energy_j=None))
    )
    await s.close()
    db = sqlite3.connect(s.path)
    (got,) = db.execute("SELECT * FROM jobs").fetchall()
    db.close()
    assert got == (
        7,
        "friend",
        "llama",
        None,
        "gpu0",
        NOW - 100,
        NOW - 90,
        "completed",
        None,
        None,
        None,
        100,
        2000,
    )


async def test_rows_past_retention_are_deleted_at_open_and_by_the_upkeep(tmp_path: Path) -> None:
    clock = [NOW]
    s = UsageStore(
        tmp_path / USAGE_FILE, retention_days=1, clock=lambda: clock[0], prune_every_s=0.05
    )
    await s.open()
    for i, ended in enumerate((NOW - 2 * 86400, NOW - 3600, NOW - 10)):
        await asyncio.wrap_future(s.record(row(i, started_at=ended - 5, ended_at=ended)))
    await s.close()
    assert [r[0] for r in rows_on_disk(s.path)] == [0, 1, 2]  # nothing pruned while running

    s = UsageStore(
        tmp_path / USAGE_FILE, retention_days=1, clock=lambda: clock[0], prune_every_s=0.05
    )
    await s.open()  # at start: the 2-day-old row goes
    upkeep = asyncio.create_task(s.upkeep())
    assert [r[0] for r in rows_on_disk(s.path)] == [1, 2]
    clock[0] = NOW + 86400 - 60  # a day later, the hourly pass finds row 1 too old
    for _ in range(100):
        await asyncio.sleep(0.02)
        if [r[0] for r in rows_on_disk(s.path)] == [2]:
            break
    assert [r[0] for r in rows_on_disk(s.path)] == [2]
    assert await s.prune() == 0
    upkeep.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await upkeep
    await s.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated-page"])
async def test_a_corrupt_ledger_is_set_aside_and_a_fresh_one_started(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / USAGE_FILE
    if damage == "garbage":
        path.write_bytes(b"this is not a database at all" * 100)
    else:
        s = store(tmp_path)
        await s.open()
        for i in range(200):
            s.record(row(i, model="m" * 200))
        await s.close()
        data = bytearray(path.read_bytes())
        data[4096 : 4096 * 3] = b"\xff" * (4096 * 2)  # smash the table's pages
        path.write_bytes(bytes(data))
    s = store(tmp_path)
    await s.open()  # never raises
    try:
        aside = matching(tmp_path, f"{USAGE_FILE}.corrupt-*")
        assert len(aside) == 1, matching(tmp_path, "*")
        assert s.error is not None and "corrupt" in s.error and aside[0].name in s.error
        await asyncio.wrap_future(s.record(row(1)))
        assert rows_on_disk(path) == [(1, "friend", "completed")]
        assert await s.groups(0.0, "borrower") == [UsageGroup("friend", 1, 10.0, 10, 20, 500.0)]
    finally:
        await s.close()


async def test_an_unopenable_ledger_is_not_set_aside_and_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    s = UsageStore(blocker / USAGE_FILE, retention_days=90)
    await s.open()
    assert s.error is not None and "cannot open" in s.error
    fut = s.record(row(1))
    await asyncio.wrap_future(fut)
    assert fut.exception() is None and s.dropped == 1
    with pytest.raises(LedgerUnreadable):
        await s.groups(0.0, "borrower")
    blocker.unlink()  # repaired: the next write opens it
    await asyncio.wrap_future(s.record(row(2)))
    assert s.error is None
    assert [r[0] for r in rows_on_disk(s.path)] == [2]
    await s.close()
    assert not matching(tmp_path, "**/*.corrupt-*")


async def test_database_calls_run_off_the_event_loop(tmp_path: Path) -> None:
    """Every call runs on the store's one thread: the loop keeps ticking while the database
    is slow (here: held locked by another connection for a while)."""
    s = store(tmp_path)
    await s.open()
    loop_thread = threading.get_ident()
    seen: set[int] = set()
    original = s._insert

    def spy(r: UsageRow) -> None:
        seen.add(threading.get_ident())
        original(r)

    s._insert = spy  # type: ignore[method-assign,assignment]
    blocker = sqlite3.connect(s.path, check_same_thread=False)
    blocker.execute("BEGIN EXCLUSIVE")
    fut = s.record(row(1))
    ticks = 0
    release_at = time.monotonic() + 0.5
    while time.monotonic() < release_at:
        await asyncio.sleep(0.01)
        ticks += 1
    blocker.rollback()
    blocker.close()
    await asyncio.wrap_future(fut)
    assert ticks >= 20  # the loop was never held up by the locked database
    assert seen and loop_thread not in seen
    many = [s.record(row(i)) for i in range(2, 52)]
    await asyncio.gather(*(asyncio.wrap_future(f) for f in many))
    groups = await s.groups(0.0, "borrower")
    assert groups[0].requests == 51
    await s.close()


async def test_groups_by_borrower_day_and_model(tmp_path: Path) -> None:
    s = store(tmp_path)
    await s.open()
    day1 = dt.datetime(2027, 3, 1, 12, 0).timestamp()
    day2 = dt.datetime(2027, 3, 2, 12, 0).timestamp()
    for r in (
        row(1, borrower="friend", model="qwen", started_at=day1, ended_at=day1 + 10),
        row(2, borrower="", model="qwen", started_at=day1, ended_at=day1 + 5, energy_j=None),
        row(3, borrower="friend", model=None, started_at=day2, ended_at=day2 + 1),
        # a wall clock that stepped back: counted as no busy time, never negative
        row(4, borrower="", model="llama", started_at=day2 + 9, ended_at=day2 + 3),
    ):
        s.record(r)
    by_borrower = await s.groups(0.0, "borrower")
    assert by_borrower == [
        UsageGroup("", 2, 5.0, 20, 40, 500.0),
        UsageGroup("friend", 2, 11.0, 20, 40, 1000.0),
    ]
    by_day = await s.groups(0.0, "day")
    assert [(g.key, g.requests, g.busy_s) for g in by_day] == [
        ("2027-03-01", 2, 15.0),
        ("2027-03-02", 2, 1.0),
    ]
    by_model = await s.groups(0.0, "model")
    assert [(g.key, g.requests) for g in by_model] == [("llama", 1), ("qwen", 2), (None, 1)]
    # while the daemon has it open, an offline read sees every committed row
    offline = await asyncio.to_thread(read_groups, s.path, 0.0, "borrower")
    assert [(g.key, g.requests) for g in offline] == [("", 2), ("friend", 2)]
    since = await s.groups(day2, "borrower")
    assert [(g.key, g.requests) for g in since] == [("", 1), ("friend", 1)]
    with pytest.raises(ValueError, match="cannot group by"):
        await s.groups(0.0, "upstream")
    await s.close()
    # the same read offline, read-only, leaving no files of its own behind (a root reader
    # must not leave root-owned -wal/-shm files the service could not open)
    assert read_groups(s.path, 0.0, "borrower") == by_borrower
    assert matching(tmp_path, "*") == [s.path]
    assert read_groups(tmp_path / "none.sqlite3", 0.0, "day") == []


def test_an_offline_read_of_a_garbage_file_says_so(tmp_path: Path) -> None:
    path = tmp_path / USAGE_FILE
    path.write_bytes(b"not a database" * 200)
    with pytest.raises(LedgerUnreadable, match="cannot"):
        read_groups(path, 0.0, "borrower")


def test_since_resolves_durations_and_local_dates() -> None:
    assert since_wall(parse_since("1h"), NOW) == NOW - 3600
    assert since_wall(parse_since("7d"), NOW) == NOW - 7 * 86400
    midnight = dt.datetime(2027, 3, 1).timestamp()
    assert since_wall(parse_since("2027-03-01"), NOW) == midnight


async def test_a_row_recorded_before_open_opens_the_ledger(tmp_path: Path) -> None:
    """The daemon builds the store before it starts, so whatever records into it can be
    given ``record`` at once."""
    s = store(tmp_path)
    await asyncio.wrap_future(s.record(row(1)))
    assert rows_on_disk(s.path) == [(1, "friend", "completed")]
    await s.open()
    await asyncio.wrap_future(s.record(row(2)))
    await s.close()
    assert [r[0] for r in rows_on_disk(s.path)] == [1, 2]
    fut = s.record(row(3))  # after close: dropped, never raised
    assert fut.done() and fut.exception() is None and s.dropped == 1


async def test_busy_between_counts_each_borrowers_part_of_a_day(tmp_path: Path) -> None:
    """What a restart reads back for the daily quotas (docs/borrowers.md): per borrower, the
    busy seconds of the jobs that ended in the day, clipped to it."""
    s = store(tmp_path)
    await s.open()
    start, end = NOW - 1000, NOW + 1000
    for r in (
        row(1, borrower="friend", started_at=start + 10, ended_at=start + 40),
        row(2, borrower="friend", started_at=start - 50, ended_at=start + 20),  # from yesterday
        row(3, borrower="", started_at=start + 100, ended_at=start + 105),
        row(4, borrower="friend", started_at=start - 500, ended_at=start - 10),  # yesterday's
        row(5, borrower="", started_at=start + 5, ended_at=start + 1),  # clock stepped back
    ):
        s.record(r)
    assert await s.busy_between(start, end) == {"friend": 50.0, "": 5.0}
    await s.close()
    with pytest.raises(LedgerUnreadable):
        await s.busy_between(start, end)
