"""The owner's controls: the lending schedule, pauses, the battery rule and exclusive apps.

One loop (``owner controls``) evaluates them on every general poll, at the schedule's next
change, when a pause ends, and whenever the presence veto changes, and writes the resulting
holds into :class:`~vacancyd.state.SharedState` (``set_holds``). A new hold raises a
``hold`` reclaim edge there, which this module hands to the reclaimer
(:meth:`~vacancyd.control.reclaim.Reclaimer.answer`), so borrowed work is drained or
cancelled by each upstream's ``on_owner_return`` policy exactly as when the owner comes back.

The owner's presence readings come in here too (:meth:`OwnerControls.record_presence`, from
the presence loop): recorded in the state, the owner edge a reading raises is handed to the
reclaimer the same way, and a change of the veto wakes the loop (an ``until_idle`` pause).

The rules are pure (``vacancyd.core.schedule``, ``pause``, ``power``, ``exclusive``,
``holds``); this module owns the effects: the wall clock, the power probe and the process
scan (each on a worker thread under the probe deadline) and the pause file in the state
directory (``STATE_DIR/pause.json``, a versioned durable-state file written atomically by
``vacancyd.runtime.durable`` through the :class:`PauseStore` the daemon passes in), so a pause
survives a restart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vacancyd.collectors.power import read_power
from vacancyd.collectors.processes import scan_running
from vacancyd.control.reclaim import Reclaimer
from vacancyd.control.spawn import Spawner
from vacancyd.core.exclusive import ExclusiveScope, ExclusiveTracker
from vacancyd.core.holds import Hold, HoldKind
from vacancyd.core.pause import Pause, PauseKind, advance, format_wall, parse_duration, parse_until
from vacancyd.core.power import PowerPolicy, PowerReading, power_hold
from vacancyd.core.schedule import Schedule
from vacancyd.state import PresenceReading, SharedState

log = logging.getLogger(__name__)

PAUSE_FILE = "pause.json"
#: With nothing else to wake it, the loop evaluates at least this often (seconds).
MAX_SLEEP_S = 30.0


class PauseStore(Protocol):
    """Where the pause is kept (``STATE_DIR/pause.json``). Blocking: called on a thread."""

    path: Path

    def load(self) -> Mapping[str, object] | None:
        """The saved pause, None when there is none; ValueError when unusable."""
        ...

    def save(self, data: Mapping[str, object] | None) -> None:
        """Replace (None: remove) the saved pause atomically; raises OSError."""
        ...


class PauseError(ValueError):
    """A pause request that cannot be honoured; the message says what was wrong."""


@dataclass
class OwnerControlsConfig:
    """Everything the loop needs, resolved from settings by the daemon.

    ``gpu_resources``: the GPU resources a GPU-exclusive app holds. ``presence_evidence``:
    the daemon can see the owner come and go (logind), which ``--until-idle`` needs.
    """

    state_dir: Path
    tz: dt.tzinfo
    zone: str
    schedule: Schedule | None = None
    power: PowerPolicy = field(default_factory=PowerPolicy)
    exclusive: Mapping[ExclusiveScope, ExclusiveTracker] = field(default_factory=dict)
    gpu_resources: frozenset[str] = frozenset()
    presence_evidence: bool = False
    poll_s: float = 3.0
    probe_timeout_s: float = 2.0


class OwnerControls:
    """Evaluates the owner's controls and keeps the pause. Event-loop only."""

    def __init__(
        self,
        state: SharedState,
        config: OwnerControlsConfig,
        store: PauseStore,
        *,
        reclaimer: Reclaimer,
        wall: Callable[[], float] = time.time,
        power_probe: Callable[[], PowerReading] = read_power,
        process_scan: Callable[[frozenset[str]], frozenset[str]] = scan_running,
        supervisor: Spawner | None = None,
    ) -> None:
        self.state = state
        #: Answers the edges the owner's presence and holds raise (the owner's return).
        self.reclaimer = reclaimer
        self.config = config
        self.store = store
        self.wall = wall
        self.power_probe = power_probe
        self.process_scan = process_scan
        self.power: PowerReading | None = None
        self.pause: Pause | None = None
        self.pause_error: str | None = None
        self.persist_error: str | None = None
        self.wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "vacancyd-owner")
        self._running: concurrent.futures.Future[Any] | asyncio.Future[Any] | None = None
        self._next_change: tuple[float, float | None] | None = None
        #: Runs the background saves of a pause that ended by itself (not essential).
        self.supervisor = supervisor
        self._saves: set[asyncio.Task[None]] = set()
        self._load_pause()

    @property
    def pause_path(self) -> Path:
        return self.store.path

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n for t in self.config.exclusive.values() for n in t.names)

    # -- the pause -----------------------------------------------------------------------

    def _load_pause(self) -> None:
        try:
            data = self.store.load()
            self.pause = None if data is None else Pause.from_json(data)
        except ValueError as exc:
            # The owner asked for a pause we can no longer read: keep lending held.
            self.pause_error = str(exc)
            self.pause = Pause(
                PauseKind.INDEFINITE,
                self.wall(),
                reason=f"the saved pause could not be read ({exc}); resume to lend again",
            )
            log.error("saved pause unreadable (%s); lending stays paused until resumed", exc)
            return
        if self.pause is not None:
            log.info("restored the owner's pause: %s", self.pause.describe(self.config.tz))

    async def _save(self) -> None:
        pause = self.pause
        try:
            await asyncio.to_thread(self.store.save, None if pause is None else pause.to_json())
        except OSError as exc:
            self.persist_error = f"cannot write {self.pause_path}: {exc.strerror or exc}"
            log.error("pause not saved, it will not survive a restart: %s", self.persist_error)
        else:
            self.persist_error = None

    async def flush(self) -> None:
        """Wait for every background save of the pause still in flight (shutdown calls this
        before the supervisor cancels its tasks, so a pause that just ended is not restored
        by the next start)."""
        while self._saves:
            await asyncio.gather(*list(self._saves), return_exceptions=True)

    def make_pause(
        self,
        *,
        until: str | None = None,
        for_: str | None = None,
        until_idle: bool = False,
        reason: str = "",
    ) -> Pause:
        """Build (not apply) a pause from a request; raises :class:`PauseError` saying why."""
        if sum((until is not None, for_ is not None, until_idle)) > 1:
            raise PauseError("give at most one of until, for and until_idle")
        now = self.wall()
        try:
            if until is not None:
                return Pause(
                    PauseKind.UNTIL, now, parse_until(until, now, self.config.tz), reason=reason
                )
            if for_ is not None:
                return Pause(PauseKind.UNTIL, now, now + parse_duration(for_), reason=reason)
        except ValueError as exc:
            raise PauseError(str(exc)) from None
        if until_idle:
            if not self.config.presence_evidence:
                raise PauseError(
                    "until_idle needs owner presence from logind ([owner] presence); this "
                    "daemon cannot see the owner leave, so the pause would never end: use "
                    "until or for instead"
                )
            return Pause(PauseKind.UNTIL_IDLE, now, seen_owner=self.state.veto.engaged)
        return Pause(PauseKind.INDEFINITE, now, reason=reason)

    async def set_pause(self, pause: Pause) -> None:
        """Apply and save a pause (replacing any other); its hold engages at once."""
        self.pause = pause
        self.pause_error = None
        log.warning("lending paused: %s", pause.describe(self.config.tz))
        await self._save()
        self.evaluate()
        self.wake.set()

    async def resume(self) -> bool:
        """End the pause; returns False when there was none."""
        if self.pause is None:
            return False
        self.pause = None
        self.pause_error = None
        log.info("lending resumed by the owner")
        await self._save()
        self.evaluate()
        self.wake.set()
        return True

    # -- evaluation ----------------------------------------------------------------------

    # -- the owner's presence ------------------------------------------------------------

    def record_presence(self, reading: PresenceReading, now: float) -> list[str]:
        """A presence reading at ``now`` (monotonic s), from the presence loop: recorded in
        the state; the owner edge it raises (the veto engaging) goes to the reclaimer, and a
        change of the veto wakes the owner-controls loop. Returns the upstreams reclaimed."""
        veto = self.state.veto.engaged
        reclaimed = self.reclaimer.answer(self.state.record_presence(reading, now))
        if self.state.veto.engaged != veto:
            self.wake.set()
        return reclaimed

    def record_presence_failure(self, error: str, now: float) -> list[str]:
        """Presence could not be read at ``now``: as :meth:`record_presence` (the veto
        engages once the last good reading is too old)."""
        veto = self.state.veto.engaged
        reclaimed = self.reclaimer.answer(self.state.record_presence_failure(error, now))
        if self.state.veto.engaged != veto:
            self.wake.set()
        return reclaimed

    def _schedule_change(self, now: float) -> float | None:
        schedule = self.config.schedule
        if schedule is None:
            return None
        cached = self._next_change
        if cached is not None:
            computed_at, value = cached
            # Reuse it unless it has passed, is an old "none ahead", or the wall clock was
            # set back past the time it was computed.
            ahead = value is not None and now < value
            fresh = ahead or (value is None and now - computed_at < 60)
            if computed_at <= now and fresh:
                return value
        value = schedule.next_change(now)
        self._next_change = (now, value)
        return value

    def holds(self, now: float, mono: float) -> tuple[Hold, ...]:
        """The holds in force at wall time ``now`` (monotonic ``mono``)."""
        tz = self.config.tz
        out: list[Hold] = []
        before = self.pause
        self.pause = advance(before, now, owner_present=self.state.veto.engaged)
        if self.pause is not before:
            if self.pause is None and before is not None:
                log.info("the owner's pause ended (%s)", before.describe(tz))
            if self.supervisor is not None:
                task = self.supervisor.spawn(self._save(), name="save pause", essential=False)
            else:
                task = asyncio.get_running_loop().create_task(self._save(), name="save pause")
            self._saves.add(task)
            task.add_done_callback(self._saves.discard)
        if self.pause is not None:
            p = self.pause
            detail = p.describe(tz) + (f": {p.reason}" if p.reason else "")
            out.append(
                Hold(
                    HoldKind.PAUSE,
                    detail,
                    ends_in_s=None if p.until is None else p.until - now,
                    until=p.until,
                )
            )
        schedule = self.config.schedule
        if schedule is not None and not schedule.is_open(now):
            change = self._schedule_change(now)
            opens = "" if change is None else f"; the next window opens {format_wall(change, tz)}"
            out.append(
                Hold(
                    HoldKind.SCHEDULE,
                    f"outside the owner's lending schedule ({self.config.zone}){opens}",
                    ends_in_s=None if change is None else change - now,
                    until=change,
                )
            )
        if self.config.power.checks and self.power is not None:
            why = power_hold(self.power, self.config.power)
            if why is not None:
                out.append(Hold(HoldKind.BATTERY, why))
        for scope, tracker in sorted(self.config.exclusive.items()):
            if not tracker.engaged:
                continue
            names = ", ".join(sorted(tracker.holding)) or "?"
            if scope is ExclusiveScope.HOST:
                out.append(Hold(HoldKind.EXCLUSIVE_APP, f"exclusive application running: {names}"))
            elif self.config.gpu_resources:
                out.append(
                    Hold(
                        HoldKind.EXCLUSIVE_APP,
                        f"GPU-exclusive application running: {names}",
                        resources=self.config.gpu_resources,
                    )
                )
        return tuple(out)

    def evaluate(self) -> None:
        """Recompute the holds now, hand them to the shared state, and the edges a new hold
        raises to the reclaimer."""
        holds = self.holds(self.wall(), self.state.clock())
        self.reclaimer.answer(self.state.set_holds(holds, self.state.clock()))

    async def _probe(self, fn: Callable[[], Any], what: str) -> tuple[Any, str | None]:
        """Run a blocking probe on the worker thread within the probe deadline."""
        if self._running is not None and not self._running.done():
            return None, f"the previous {what} is still running past its deadline"
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, fn)
        self._running = future
        try:
            async with asyncio.timeout(self.config.probe_timeout_s):
                return await asyncio.shield(future), None
        except TimeoutError:
            return None, f"{what} took longer than {self.config.probe_timeout_s:g} s"
        except Exception as exc:  # a probe failure must read as "could not tell"
            return None, f"{what} failed: {exc}"

    async def sample(self) -> None:
        """Probe power and processes (as configured), then evaluate."""
        if self.config.power.checks:
            reading, error = await self._probe(self.power_probe, "power probe")
            if error is not None:
                log.warning("power state unknown: %s", error)
                reading = PowerReading(None, error=error)
            self.power = reading
        names = self.names
        if names:
            running, error = await self._probe(lambda: self.process_scan(names), "process scan")
            if error is not None:
                log.warning("exclusive-app scan failed (%s); every exclusive app counts", error)
            mono = self.state.clock()
            for tracker in self.config.exclusive.values():
                if tracker.observe(running, mono):
                    log.info(
                        "exclusive apps (%s) %s",
                        ", ".join(sorted(tracker.names)),
                        "engaged: " + ", ".join(sorted(tracker.holding))
                        if tracker.engaged
                        else "released",
                    )
        self.evaluate()

    def _sleep_s(self) -> float:
        now = self.wall()
        wait = min(self.config.poll_s, MAX_SLEEP_S)
        for until in (self._schedule_change(now), self.pause.until if self.pause else None):
            if until is not None:
                wait = min(wait, max(0.05, until - now))
        mono = self.state.clock()
        for tracker in self.config.exclusive.values():
            for due in (tracker.engage_in_s(mono), tracker.release_in_s(mono)):
                if due is not None:
                    wait = min(wait, max(0.05, due))
        return wait

    async def run(self) -> None:
        """The loop; never returns (cancel to stop)."""
        try:
            while True:
                self.wake.clear()
                await self.sample()
                try:
                    async with asyncio.timeout(self._sleep_s()):
                        await self.wake.wait()
                except TimeoutError:
                    pass
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- /status -------------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """The ``owner_controls`` part of /status (wall times are epoch seconds)."""
        now = self.wall()
        tz = self.config.tz
        schedule = self.config.schedule
        sched_doc = None
        if schedule is not None:
            change = self._schedule_change(now)
            sched_doc = {
                "timezone": self.config.zone,
                "open": schedule.is_open(now),
                "windows": schedule.describe(),
                "next_change": change,
                "next_change_local": None if change is None else format_wall(change, tz),
                "next_change_in_s": None if change is None else round(change - now, 1),
            }
        pause = self.pause
        pause_doc = None
        if pause is not None:
            pause_doc = {
                **pause.to_json(),
                "until_local": None if pause.until is None else format_wall(pause.until, tz),
                "ends_in_s": None if pause.until is None else round(pause.until - now, 1),
                "detail": pause.describe(tz),
            }
        mono = self.state.clock()
        return {
            "holds": [
                {
                    "kind": h.kind.value,
                    "detail": h.detail,
                    "resources": None if h.resources is None else sorted(h.resources),
                    "until": h.until,
                    "ends_in_s": None if h.ends_in_s is None else round(h.ends_in_s, 1),
                }
                for h in self.state.holds
            ],
            "schedule": sched_doc,
            "pause": pause_doc,
            "pause_error": self.pause_error,
            "pause_persist_error": self.persist_error,
            "power": None
            if not self.config.power.checks
            else {
                "has_battery": None if self.power is None else self.power.has_battery,
                "plugged": None if self.power is None else self.power.plugged,
                "percent": None if self.power is None else self.power.percent,
                "error": None if self.power is None else self.power.error,
                "lend_on_battery": self.config.power.lend_on_battery,
                "min_battery_percent": self.config.power.min_battery_percent,
            },
            "exclusive_apps": {
                scope.value: {
                    "names": sorted(t.names),
                    "engaged": t.engaged,
                    "holding": sorted(t.holding),
                    "engage_in_s": t.engage_in_s(mono),
                    "release_in_s": t.release_in_s(mono),
                }
                for scope, t in sorted(self.config.exclusive.items())
            },
        }
