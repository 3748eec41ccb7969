"""The durable usage ledger: one row per finished borrowed job in ``STATE_DIR/usage.sqlite3``
(stdlib :mod:`sqlite3`, WAL), and the queries ``vacancyd usage`` and ``GET /usage`` group
it by (docs/borrowers.md).

Every database call runs on the store's own single thread (:class:`UsageStore`), so the event
loop never waits for the disk; each row is committed the moment it is recorded, so a
``kill -9`` loses at most the jobs still running. Rows whose job ended more than
``retention_days`` ago are deleted at open and once an hour. A database SQLite says is
corrupt (or not a database at all) is renamed aside, ``usage.sqlite3.corrupt-<UTC time>``,
and a fresh one is started; the store keeps the error (:attr:`UsageStore.error`, shown in
``/status``) and never raises it. A database that cannot be opened for any other reason (a
directory it may not write) is left alone: the store records nothing, keeps the error and
tries again at the next row and the next hourly upkeep.

The same database keeps the lender's history for the status page's timeline (table
``history``, one sample a minute and one at each presence or lending edge,
:mod:`vacancyd.runtime.history`): 48 hours of it, at most
:data:`~vacancyd.core.history.MAX_SAMPLES` rows, pruned with the jobs.

Times are wall-clock seconds since the epoch; a local day is the lender's local time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from vacancyd.core import history as history_rules
from vacancyd.core.history import HistorySample
from vacancyd.core.usage import GROUP_BY, Since, UsageGroup, UsageRow

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The ledger's file name under ``state_dir``.
USAGE_FILE = "usage.sqlite3"
#: Seconds between two retention passes.
PRUNE_EVERY_S = 3600.0
#: A recorded row waits at most this long for the rows of other jobs ending meanwhile, then
#: they are committed together (seconds). A commit costs the lender about as much CPU as
#: forwarding a request, so one per job would make the ledger the proxy's largest cost on a
#: busy lender; a kill -9 may lose the rows of jobs that ended this long before it.
COMMIT_DELAY_S = 0.2
#: The schema's version (``PRAGMA user_version``).
SCHEMA_VERSION = 1
#: SQLite's primary result codes that mean the file is not a usable database.
_CORRUPT_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id INTEGER NOT NULL,
    borrower TEXT NOT NULL,
    upstream TEXT NOT NULL,
    model TEXT,
    resource TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL,
    outcome TEXT NOT NULL,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    energy_j REAL,
    bytes_in INTEGER NOT NULL,
    bytes_out INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_ended_at ON jobs (ended_at);
CREATE TABLE IF NOT EXISTS history (
    at_wall REAL NOT NULL,
    owner_present INTEGER NOT NULL,
    lending INTEGER NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_at_wall ON history (at_wall);
"""
_INSERT_HISTORY = (
    "INSERT INTO history (at_wall, owner_present, lending, detail) VALUES (?, ?, ?, ?)"
)

_INSERT = (
    "INSERT INTO jobs (job_id, borrower, upstream, model, resource, started_at, ended_at, "
    "outcome, prompt_tokens, completion_tokens, energy_j, bytes_in, bytes_out) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)

#: The SQL expression of each grouping's key.
_GROUP_KEY = {
    "borrower": "borrower",
    "day": "date(ended_at, 'unixepoch', 'localtime')",
    "model": "model",
}


def is_corruption(exc: BaseException) -> bool:
    """Whether ``exc`` says the database file itself is damaged or is not a database
    (SQLITE_CORRUPT, SQLITE_NOTADB), as opposed to a locked, missing or unwritable one."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) in _CORRUPT_CODES
    return not isinstance(exc, sqlite3.OperationalError)


def since_wall(since: Since, now: float) -> float:
    """The wall time (s) a report starting at ``since`` starts at: ``now`` minus its seconds,
    or its day's local midnight."""
    if since.seconds is not None:
        return now - since.seconds
    assert since.day is not None
    return time.mktime(dt.datetime.combine(since.day, dt.time()).timetuple())


def query_groups(db: sqlite3.Connection, since: float, by: str) -> list[UsageGroup]:
    """The rows of jobs that ended at or after ``since`` (wall s), grouped ``by`` one of
    :data:`~vacancyd.core.usage.GROUP_BY`, ordered by key. Raises ValueError for an unknown
    ``by`` and sqlite3 errors as they come."""
    if by not in GROUP_BY:
        raise ValueError(f"cannot group by {by!r}: choose one of {', '.join(GROUP_BY)}")
    key = _GROUP_KEY[by]
    cursor = db.execute(
        f"SELECT {key} AS k, count(*), total(max(ended_at - started_at, 0)), "
        "sum(prompt_tokens), sum(completion_tokens), sum(energy_j) "
        "FROM jobs WHERE ended_at >= ? GROUP BY k ORDER BY k IS NULL, k",
        (since,),
    )
    return [
        UsageGroup(
            key=None if k is None else str(k),
            requests=int(n),
            busy_s=float(busy),
            prompt_tokens=None if prompt is None else int(prompt),
            completion_tokens=None if completion is None else int(completion),
            energy_j=None if energy is None else float(energy),
        )
        for k, n, busy, prompt, completion, energy in cursor
    ]


class LedgerUnreadable(Exception):
    """The ledger file exists but cannot be read (permissions, corruption, not a database)."""


def ledger_exists(path: Path) -> bool:
    """Whether the ledger file is there; raises :class:`LedgerUnreadable` when that cannot
    be told (a state directory the caller may not search)."""
    try:
        path.stat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise LedgerUnreadable(f"cannot look for {path}: {exc.strerror or exc}") from exc
    return True


def read_groups(path: Path, since: float, by: str) -> list[UsageGroup]:
    """Read the ledger at ``path`` offline, read-only (``vacancyd usage`` without ``--url``),
    grouped as :func:`query_groups` does. A missing file is an empty ledger. Raises
    :class:`LedgerUnreadable` saying why for a file that cannot be read, ValueError for an
    unknown ``by``."""
    if not ledger_exists(path):
        return []
    # A read-only open of a WAL database creates its -wal and -shm files when they are not
    # there, owned by the reader: root's `sudo vacancyd usage` would leave files the service's
    # user cannot open. Without a -wal file no daemon has rows outside the main file, so it
    # is read as immutable (no side files); with one, the daemon's own files are used.
    immutable = "" if path.with_name(path.name + "-wal").exists() else "&immutable=1"
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro{immutable}", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        raise LedgerUnreadable(f"cannot open {path}: {exc}") from exc
    try:
        return query_groups(db, since, by)
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []  # created, never written
        raise LedgerUnreadable(f"cannot read {path}: {exc}") from exc
    except sqlite3.Error as exc:
        raise LedgerUnreadable(f"cannot read {path}: {exc}") from exc
    finally:
        db.close()


class UsageStore:
    """The usage ledger of a running daemon.

    ``path``: the database file; ``retention_days``: rows whose job ended longer ago are
    deleted; ``clock``: wall time (s), for retention and ``since``. :meth:`open` and
    :meth:`close` are awaited on the event loop; every database call runs on the store's one
    worker thread. Nothing here raises a database error to its caller: :attr:`error` says
    what went wrong last (None when all is well).
    """

    def __init__(
        self,
        path: Path,
        *,
        retention_days: float,
        clock: Callable[[], float] = time.time,
        prune_every_s: float = PRUNE_EVERY_S,
        commit_delay_s: float = COMMIT_DELAY_S,
    ) -> None:
        self.path = path
        self.retention_s = retention_days * 86400.0
        self.clock = clock
        self.prune_every_s = prune_every_s
        self.commit_delay_s = commit_delay_s
        #: That a corrupt ledger was set aside (kept until the daemon restarts).
        self._set_aside_note: str | None = None
        #: Why the ledger cannot be opened or written now (cleared by the next success).
        self._failure: str | None = None
        #: Rows that could not be written (the ledger was unusable or a write failed).
        self.dropped = 0
        self._db: sqlite3.Connection | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="vacancyd-usage"
        )
        self._closed = False
        #: Rows recorded and not yet taken by the store's thread, and the one pending write
        #: that will take them (None: none pending). Guarded by ``_pending_lock``.
        self._pending: list[UsageRow] = []
        self._batch: concurrent.futures.Future[None] | None = None
        self._pending_lock = threading.Lock()
        #: The loop's timer that hands the pending rows to the thread (None: none set).
        self._flush_timer: asyncio.TimerHandle | None = None

    @property
    def error(self) -> str | None:
        """What went wrong, for ``/status``: that a corrupt ledger was set aside (until the
        daemon restarts) and why it cannot be opened or written now; None when all is well."""
        parts = [p for p in (self._set_aside_note, self._failure) if p]
        return "; ".join(parts) or None

    # -- the loop's side ----------------------------------------------------------------

    async def open(self) -> None:
        """Open (or create) the ledger off the loop, set aside a corrupt one and delete rows
        past retention. Never raises: a failure is kept in :attr:`error`. The hourly pass is
        :meth:`upkeep`, which the caller runs as a task of its own."""
        await self._run(self._open_and_prune)

    async def upkeep(self) -> None:
        """Every ``prune_every_s`` seconds, delete the rows past retention (and open the
        ledger if it could not be opened before), until cancelled. Never raises otherwise."""
        while True:
            await asyncio.sleep(self.prune_every_s)
            if self._closed:
                return
            await self._run(self._open_and_prune)

    async def close(self) -> None:
        """Wait for the rows already recorded to be written and close the database (off the
        loop). Cancel :meth:`upkeep` first."""
        if not self._closed:
            self._closed = True
            self._flush()  # the rows still waiting for their commit go first
            await self._run(self._close_db)  # runs after every row queued before it
            self._executor.shutdown(wait=False)  # nothing is left; never join on the loop

    def record(self, row: UsageRow) -> concurrent.futures.Future[None]:
        """Write ``row`` and commit it, on the store's thread, within
        :attr:`commit_delay_s` seconds together with the rows recorded meanwhile (at once
        when called outside an event loop, and at :meth:`close`); returns at once (never
        blocks the loop; also before :meth:`open`, the first row then opens the ledger).
        The returned future is done once the row is committed (or dropped: the error is
        then in :attr:`error`); it never raises."""
        if self._closed:
            self.dropped += 1
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        with self._pending_lock:
            self._pending.append(row)
            if self._batch is not None:
                return self._batch
            batch: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._batch = batch
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._executor.submit(self._insert_pending)
        else:
            self._flush_timer = loop.call_later(self.commit_delay_s, self._flush)
        return batch

    def _flush(self) -> None:
        """Hand the rows waiting for their commit to the store's thread now."""
        timer, self._flush_timer = self._flush_timer, None
        if timer is not None:
            timer.cancel()
        with self._pending_lock:
            waiting = self._batch is not None
        if waiting:
            self._executor.submit(self._insert_pending)

    async def groups(self, since: Since | float, by: str) -> list[UsageGroup]:
        """The ledger grouped ``by`` borrower, day or model, for the jobs that ended since
        ``since`` (a :class:`Since`, or wall seconds). Raises :class:`LedgerUnreadable` when
        the ledger cannot be read now, ValueError for an unknown ``by``."""
        start = since if isinstance(since, float | int) else since_wall(since, self.clock())
        if self._closed:
            raise LedgerUnreadable("the usage ledger is closed")
        if by not in GROUP_BY:
            raise ValueError(f"cannot group by {by!r}: choose one of {', '.join(GROUP_BY)}")
        self._flush()  # a report includes every job recorded before it was asked for
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._query, float(start), by
        )

    async def busy_between(self, start: float, end: float) -> dict[str, float]:
        """Busy seconds per borrower (``""`` unnamed) of the jobs that ended at or after
        ``start`` (wall s), each counted only from ``start`` to ``end`` (a local day's
        bounds: a job that began before midnight counts its part after it). Raises
        :class:`LedgerUnreadable` when the ledger cannot be read now."""
        if self._closed:
            raise LedgerUnreadable("the usage ledger is closed")
        self._flush()
        return await self._run(lambda: self._query_busy(start, end))

    def record_history(self, sample: HistorySample) -> concurrent.futures.Future[None]:
        """Write one history sample (vacancyd.runtime.history) to the ``history`` table and
        commit it, on the store's thread; returns at once and never raises, like
        :meth:`record`. Samples older than 48 hours, and the oldest past
        :data:`~vacancyd.core.history.MAX_SAMPLES`, are deleted at open and hourly."""
        if self._closed:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        return self._executor.submit(self._insert_history, sample)

    async def history(self, since: float) -> list[HistorySample]:
        """The history samples taken at or after ``since`` (wall s), oldest first (rows that
        cannot be read are skipped). Raises :class:`LedgerUnreadable` when the database
        cannot be read now."""
        if self._closed:
            raise LedgerUnreadable("the usage ledger is closed")
        return await self._run(lambda: self._query_history(since))

    async def prune(self) -> int:
        """Delete the rows past retention now (and the history past its own); the number of
        jobs deleted (0 when the ledger is not usable)."""
        return await self._run(self._prune)

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # -- the store's thread -------------------------------------------------------------

    def _open_and_prune(self) -> int:
        if self._db is None and not self._open_db():
            return 0
        return self._prune()

    def _open_db(self) -> bool:
        """Open the database, setting a corrupt one aside; False (with :attr:`error` set)
        when it could not be opened."""
        try:
            self._db = self._connect()
            self._failure = None
            return True
        except sqlite3.Error as exc:
            if not is_corruption(exc):
                self._fail(f"cannot open the usage ledger {self.path}: {exc}")
                return False
            aside = self._set_aside(exc)
            if aside is None:
                return False
        try:
            self._db = self._connect()
        except sqlite3.Error as exc:
            self._fail(f"cannot start a fresh usage ledger {self.path}: {exc}")
            return False
        self._failure = None
        self._set_aside_note = (
            f"the usage ledger was corrupt ({aside[1]}); it was set aside as {aside[0].name} "
            "and a fresh one started"
        )
        log.error("%s", self._set_aside_note)
        return True

    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise sqlite3.OperationalError(f"cannot create {self.path.parent}: {exc}") from exc
        db = sqlite3.connect(self.path, timeout=5.0, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # WAL with synchronous=NORMAL survives a crash of the process (kill -9); only a
            # power loss may take the last commits.
            db.execute("PRAGMA synchronous=NORMAL")
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check[0] if check else 'no answer'}")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"unknown usage ledger schema version {version}")
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            db.close()
            raise
        return db

    def _set_aside(self, exc: sqlite3.Error) -> tuple[Path, str] | None:
        """Rename the corrupt file (and its WAL) aside; (new path, why) or None (error set)."""
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        try:
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                side = self.path.with_name(self.path.name + suffix)
                if side.exists():
                    if suffix == "-wal":
                        os.replace(side, aside.with_name(aside.name + suffix))
                    else:
                        side.unlink()
        except OSError as move:
            self._fail(
                f"the usage ledger {self.path} is corrupt ({exc}) and could not be set aside: "
                f"{move}"
            )
            return None
        return aside, str(exc)

    def _insert_pending(self) -> None:
        """Write every row recorded since the last write, then tell their recorders."""
        with self._pending_lock:
            rows, self._pending = self._pending, []
            batch, self._batch = self._batch, None
        try:
            if rows:
                self._insert_rows(rows)
        finally:
            if batch is not None:
                batch.set_result(None)

    def _insert_rows(self, rows: list[UsageRow]) -> None:
        """One row on its own, several (jobs that ended close together) in one transaction,
        so a burst of short jobs costs one commit, not one each. A failed transaction is
        retried row by row."""
        if len(rows) == 1:
            self._insert(rows[0])
            return
        if self._db is None and not self._open_db():
            self.dropped += len(rows)
            return
        assert self._db is not None
        try:
            self._db.execute("BEGIN")
            self._db.executemany(_INSERT, [_values(row) for row in rows])
            self._db.execute("COMMIT")
            self._failure = None
            return
        except sqlite3.Error:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
        for row in rows:
            self._insert(row)

    def _insert(self, row: UsageRow) -> None:
        if self._write(_INSERT, _values(row), f"job {row.job_id} in the usage ledger"):
            self._failure = None
        else:
            self.dropped += 1

    def _write(self, sql: str, params: Sequence[object], what: str) -> bool:
        """Execute one autocommitted write (committed when it returns); a ledger found
        corrupt is set aside and the write tried once more on a fresh one. Returns whether
        it was written; when not, why is in :attr:`error` (``what`` names it)."""
        if self._db is None and not self._open_db():
            return False
        for attempt in (1, 2):
            assert self._db is not None
            try:
                self._db.execute(sql, params)
                return True
            except sqlite3.Error as exc:
                if attempt == 1 and is_corruption(exc):
                    self._close_db()
                    if self._open_db():
                        continue
                else:
                    self._fail(f"could not record {what}: {exc}")
                return False
        return False

    def _query(self, since: float, by: str) -> list[UsageGroup]:
        if self._db is None and not self._open_db():
            raise LedgerUnreadable(self.error or "the usage ledger is not open")
        assert self._db is not None
        try:
            return query_groups(self._db, since, by)
        except sqlite3.Error as exc:
            raise LedgerUnreadable(f"cannot read the usage ledger {self.path}: {exc}") from exc

    def _query_busy(self, start: float, end: float) -> dict[str, float]:
        if self._db is None and not self._open_db():
            raise LedgerUnreadable(self.error or "the usage ledger is not open")
        assert self._db is not None
        try:
            rows = self._db.execute(
                "SELECT borrower, SUM(MAX(0.0, MIN(ended_at, ?) - MAX(started_at, ?))) "
                "FROM jobs WHERE ended_at >= ? GROUP BY borrower",
                (end, start, start),
            ).fetchall()
        except sqlite3.Error as exc:
            raise LedgerUnreadable(f"cannot read the usage ledger {self.path}: {exc}") from exc
        return {str(name): float(total or 0.0) for name, total in rows}

    def _prune(self) -> int:
        if self._db is None:
            return 0
        self._prune_history()
        try:
            cursor = self._db.execute(
                "DELETE FROM jobs WHERE ended_at < ?", (self.clock() - self.retention_s,)
            )
        except sqlite3.Error as exc:
            self._fail(f"could not delete old rows from the usage ledger: {exc}")
            return 0
        return cursor.rowcount

    def _insert_history(self, sample: HistorySample) -> None:
        self._write(_INSERT_HISTORY, history_rules.to_row(sample), "the lender's history")

    def _query_history(self, since: float) -> list[HistorySample]:
        if self._db is None and not self._open_db():
            raise LedgerUnreadable(self.error or "the usage ledger is not open")
        assert self._db is not None
        try:
            cursor = self._db.execute(
                "SELECT at_wall, owner_present, lending, detail FROM history "
                "WHERE at_wall >= ? ORDER BY at_wall",
                (since,),
            )
            rows = cursor.fetchall()
        except sqlite3.Error as exc:
            raise LedgerUnreadable(f"cannot read the history in {self.path}: {exc}") from exc
        samples = (history_rules.from_row(tuple(row)) for row in rows)
        return [s for s in samples if s is not None]

    def _prune_history(self) -> int:
        """Delete history past its retention (48 h) and past its row bound; the number of
        rows deleted."""
        if self._db is None:
            return 0
        cutoff = history_rules.retention_cutoff(self.clock())
        try:
            old = self._db.execute("DELETE FROM history WHERE at_wall < ?", (cutoff,)).rowcount
            over = self._db.execute(
                "DELETE FROM history WHERE rowid NOT IN "
                "(SELECT rowid FROM history ORDER BY at_wall DESC LIMIT ?)",
                (history_rules.MAX_SAMPLES,),
            ).rowcount
        except sqlite3.Error as exc:
            self._fail(f"could not delete old history from the usage ledger: {exc}")
            return 0
        return old + over

    def _close_db(self) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None

    def _fail(self, message: str) -> None:
        if message != self._failure:
            log.error("%s", message)
        self._failure = message


def _values(row: UsageRow) -> tuple[object, ...]:
    """``row`` as the parameters of the ledger's INSERT."""
    return (
        row.job_id,
        row.borrower,
        row.upstream,
        row.model,
        row.resource,
        row.started_at,
        row.ended_at,
        str(row.outcome),
        row.prompt_tokens,
        row.completion_tokens,
        row.energy_j,
        row.bytes_in,
        row.bytes_out,
    )
