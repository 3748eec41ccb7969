"""Lend a GPU under a lower power limit (``lend_power_limit_w``, docs/hardware-limits.md).

:class:`PowerLimiter` is the :class:`~vacancyd.control.observe.JobObserver` that
:class:`~vacancyd.control.work.Work` tells when a borrowed job starts and stops holding its
resources. When the first job takes a GPU that has a lending limit, the card's own limit is
read, written durably to ``state_dir/power-limits.json`` (atomically, fsynced), and only
then is the lending limit set (never above the card's own limit). It is restored when the
last job releases the card, when the owner comes back (the host veto, or one of the owner's
holds) even while work still runs, and when vacancyd stops. A limit that was never restored
(``kill -9``, a power cut) is restored at the next start from that file, and the file's entry
is removed once it has been.

Where the driver refuses (not root, not supported, out of range, a lost GPU), the problem is
shown in ``/status`` (``resources.NAME.power_limit``) and logged, and lending goes on
without the limit; a restore that fails is retried every :data:`RETRY_S` seconds. Every NVML
and file call runs on the limiter's own single worker thread, one at a time, never on the
event loop. Which limit should be in force is :func:`vacancyd.core.powerlimit.wants_lend_limit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from vacancyd.collectors.base import ProbeError
from vacancyd.collectors.nvidia import PowerLimitError
from vacancyd.core.events import StateEvent
from vacancyd.core.ledger import Job
from vacancyd.core.powerlimit import PowerLimits, check_lend_limit, wants_lend_limit
from vacancyd.core.reasons import PowerLimitProblem
from vacancyd.core.status import PowerLimitStatus
from vacancyd.runtime import durable
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

#: The durable record of the limits to restore, under ``state_dir``.
POWER_LIMITS_FILE = "power-limits.json"
POWER_LIMITS_VERSION = 1
#: A restore the driver refused is tried again this often (seconds).
RETRY_S = 30.0
#: At a stop, restoring every limit may take this long (seconds) before vacancyd stops
#: without it (the file keeps the originals for the next start).
RESTORE_AT_STOP_S = 5.0

T = TypeVar("T")


class PowerControl(Protocol):
    """One GPU's power limit (``vacancyd.collectors.nvidia.NvmlPowerControl``); blocking.
    Every method raises ``PowerLimitError`` (a ``ProbeError`` with ``problem``)."""

    def uuid(self) -> str: ...

    def read(self) -> PowerLimits: ...

    def set(self, mw: int) -> None: ...


@dataclass
class _Card:
    resource: str
    #: the ``device`` selector as configured, kept in the file to find the card again
    device: str
    control: PowerControl
    #: the lending limit (mW); None for a card only left to restore
    lend_mw: int | None
    #: the card's own limit (mW), read before the first change; the one restored
    original_mw: int | None = None
    uuid: str | None = None
    #: a limit other than the card's own may be in force (the lending one, or a leftover)
    applied: bool = False
    #: the driver refused the lending limit: not tried again until the card is released
    refused: bool = False
    problem: PowerLimitProblem | None = None
    error: str | None = None


class PowerLimiter:
    """Applies and restores each GPU's lending power limit (see the module docstring).

    ``cards``: resource -> (its ``device`` selector text, its power control, the lending
    limit in mW). ``control_for``: a power control for a selector text, for a card the file
    names that is not configured with a limit any more. Call :meth:`run` as a task from the
    start and :meth:`restore_at_stop` at the end.
    """

    def __init__(
        self,
        state: SharedState,
        state_dir: Path,
        cards: Mapping[str, tuple[str, PowerControl, int]],
        control_for: Callable[[str], PowerControl],
    ) -> None:
        self.state = state
        self.path = state_dir / POWER_LIMITS_FILE
        self.control_for = control_for
        self.cards: dict[str, _Card] = {
            name: _Card(name, device, control, lend_mw)
            for name, (device, control, lend_mw) in cards.items()
        }
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="power-limit")
        #: Why the file cannot be used; no lending limit is applied while it is unusable.
        self._file_error: str | None = None
        self._stopping = False
        for card in self.cards.values():
            self._show(card)
        state.subscribe(self._on_state)

    # -- what tells it to look again ---------------------------------------------------------

    def job_started(self, job: Job) -> None:
        self._look_again()

    def job_ended(self, job: Job) -> None:
        self._look_again()

    def _on_state(self, _event: StateEvent) -> None:
        self._look_again()  # the veto, a hold, the stop: anything may change the answer

    def _look_again(self) -> None:
        if any(self._due(card) for card in self.cards.values()):
            self._wake.set()

    # -- the task --------------------------------------------------------------------------

    async def run(self) -> None:
        """Restore what the file says was left applied, then keep every card's limit as
        :func:`wants_lend_limit` says, until cancelled."""
        await self._load_leftovers()
        while True:
            self._wake.clear()
            await self._converge()
            retry = RETRY_S if any(self._due(c) for c in self.cards.values()) else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(retry):
                    await self._wake.wait()

    async def restore_at_stop(self) -> None:
        """Restore every card's own limit (at most :data:`RESTORE_AT_STOP_S`); what cannot be
        restored stays in the file for the next start. Never raises."""
        self._stopping = True
        try:
            async with asyncio.timeout(RESTORE_AT_STOP_S):
                await self._converge()
        except TimeoutError:
            log.error(
                "restoring the GPU power limits took over %g s; stopping without it (the "
                "next start restores them from %s)",
                RESTORE_AT_STOP_S,
                self.path,
            )
        except Exception:
            log.exception("restoring the GPU power limits failed")
        left = [c.resource for c in self.cards.values() if c.applied]
        if left:
            log.error(
                "GPU power limit of %s not restored; the next start restores it from %s",
                ", ".join(left),
                self.path,
            )
        self._executor.shutdown(wait=False)

    # -- deciding ----------------------------------------------------------------------------

    def _wanted(self, card: _Card) -> bool:
        if card.lend_mw is None or self._file_error is not None:
            return False
        state = self.state
        return wants_lend_limit(
            jobs=state.ledger.jobs_per_resource().get(card.resource, 0),
            owner_back=state.veto.engaged or bool(state.holds),
            stopping=self._stopping or state.stopping,
        )

    def _due(self, card: _Card) -> bool:
        """Whether ``card`` needs a driver call: the lending limit wanted and not yet tried
        in this episode, or a limit in force that should not be."""
        wanted = self._wanted(card)
        if not wanted and card.refused:
            card.refused = False  # the card is released: the next job tries again
        return (wanted and not card.applied and not card.refused) or (not wanted and card.applied)

    async def _converge(self) -> None:
        for card in list(self.cards.values()):
            if not self._due(card):
                continue
            if self._wanted(card):
                await self._apply(card)
            else:
                await self._restore(card)

    # -- applying and restoring ----------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    async def _apply(self, card: _Card) -> None:
        assert card.lend_mw is not None
        try:
            if card.original_mw is None:
                limits = await self._call(card.control.read)
                card.uuid = await self._call(card.control.uuid)
                card.original_mw = limits.current_mw
                why = check_lend_limit(card.lend_mw, limits)
                if why is not None:
                    card.original_mw = None
                    self._refuse(card, PowerLimitProblem.OUT_OF_RANGE, why)
                    return
            target = min(card.lend_mw, card.original_mw)
            try:
                await self._call(self._save, card.resource)
            except OSError as exc:
                self._refuse(
                    card,
                    PowerLimitProblem.FAILED,
                    f"the original limit cannot be written to {self.path} first: "
                    f"{exc.strerror or exc}",
                )
                return
            card.applied = True  # from here on the file may name a limit to restore
            await self._call(card.control.set, target)
        except ProbeError as exc:
            changing, card.applied = card.applied, False  # refused: the card is unchanged
            self._refuse(card, _problem(exc), str(exc))
            if changing:
                await self._forget(card)
            return
        card.problem = card.error = None
        log.info(
            "resource %s: power limit %g W while borrowed work runs (the card's own: %g W)",
            card.resource,
            target / 1000,
            (card.original_mw or 0) / 1000,
        )
        self._show(card)

    async def _restore(self, card: _Card) -> None:
        original = card.original_mw
        if original is None:  # nothing was read, so nothing was changed
            card.applied = False
            self._show(card)
            return
        try:
            await self._call(card.control.set, original)
        except ProbeError as exc:
            if card.error != str(exc):
                log.error(
                    "resource %s: restoring its power limit of %g W failed (retried every "
                    "%g s): %s",
                    card.resource,
                    original / 1000,
                    RETRY_S,
                    exc,
                )
            card.problem, card.error = _problem(exc), str(exc)
            self._show(card)
            return
        card.applied = False
        card.problem = card.error = None
        log.info("resource %s: power limit restored to %g W", card.resource, original / 1000)
        if card.lend_mw is None:
            del self.cards[card.resource]  # a leftover: done with it
            self.state.power_limits.pop(card.resource, None)
        else:
            self._show(card)
        await self._forget(card)

    def _refuse(self, card: _Card, problem: PowerLimitProblem, why: str) -> None:
        card.refused = True
        card.problem, card.error = problem, why
        log.warning(
            "resource %s: the power limit for lending was not applied (%s); lending goes on "
            "without it: %s",
            card.resource,
            problem.value,
            why,
        )
        self._show(card)

    def _show(self, card: _Card) -> None:
        error = card.error if self._file_error is None else self._file_error
        self.state.power_limits[card.resource] = PowerLimitStatus(
            lend_w=None if card.lend_mw is None else card.lend_mw / 1000,
            original_w=None if card.original_mw is None else card.original_mw / 1000,
            applied=card.applied,
            problem=None if card.problem is None else card.problem.value,
            error=error,
        )

    # -- the file ------------------------------------------------------------------------------

    def _save(self, changing: str | None = None) -> None:
        """Write the original limit of every card whose limit may not be its own (and of
        ``changing``, about to be changed); remove the file when there is none. Blocking;
        raises OSError."""
        entries = {
            c.resource: {"device": c.device, "uuid": c.uuid, "original_mw": c.original_mw}
            for c in self.cards.values()
            if c.original_mw is not None and (c.applied or c.resource == changing)
        }
        if entries:
            durable.write_state(self.path, {"version": POWER_LIMITS_VERSION, "gpus": entries})
        else:
            durable.remove_state(self.path)

    async def _forget(self, card: _Card) -> None:
        try:
            await self._call(self._save)
        except OSError as exc:
            # Harmless: the next start sets the card's own limit once more.
            log.warning("cannot update %s after restoring %s: %s", self.path, card.resource, exc)

    async def _load_leftovers(self) -> None:
        """Read the file a previous run left: every card it names has a limit to restore."""
        try:
            data = await self._call(durable.read_state, self.path, {POWER_LIMITS_VERSION})
        except durable.StateFileError as exc:
            self._file_error = (
                f"{exc}; no lending power limit is applied until it is repaired or removed "
                "(the card's own limit may still be the lending one)"
            )
            log.error("GPU power limits: %s", self._file_error)
            for card in self.cards.values():
                self._show(card)
            return
        if data is None:
            return
        gpus = data.get("gpus")
        for resource, entry in (gpus if isinstance(gpus, dict) else {}).items():
            await self._adopt(str(resource), entry)
        await self._converge()

    async def _adopt(self, resource: str, entry: object) -> None:
        """Take over one leftover entry: the limit it names is restored by :meth:`_converge`."""
        if not isinstance(entry, dict):
            log.warning("GPU power limits: ignoring the unreadable entry for %s", resource)
            return
        device, uuid, original = entry.get("device"), entry.get("uuid"), entry.get("original_mw")
        if not isinstance(device, str) or not isinstance(original, int) or original <= 0:
            log.warning("GPU power limits: ignoring the unreadable entry for %s", resource)
            return
        card = self.cards.get(resource)
        if card is None or card.device != device:
            try:
                control = self.control_for(device)
            except ValueError as exc:
                log.warning("GPU power limits: ignoring %s: %s", resource, exc)
                return
            card = _Card(resource, device, control, None)
            self.cards[resource] = card
        try:
            found = await self._call(card.control.uuid)
        except ProbeError as exc:
            found = None
            card.problem, card.error = _problem(exc), str(exc)
        if uuid is not None and found is not None and found != uuid:
            log.warning(
                "GPU power limits: %s was %s when its limit was changed and is %s now; "
                "not restoring a limit on another card",
                resource,
                uuid,
                found,
            )
            if card.lend_mw is None:
                del self.cards[resource]
            return
        card.uuid = uuid if isinstance(uuid, str) else found
        card.original_mw = original
        card.applied = True  # whatever is in force, the saved limit is the card's own
        log.warning(
            "resource %s: vacancyd stopped without restoring its power limit; restoring %g W now",
            resource,
            original / 1000,
        )
        self._show(card)


def _problem(exc: ProbeError) -> PowerLimitProblem:
    return exc.problem if isinstance(exc, PowerLimitError) else PowerLimitProblem.FAILED
