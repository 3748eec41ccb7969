"""Samples on demand: a collector samples on its timer, and sooner when someone asks for
a fresh sample of its key (:class:`~vacancyd.core.observations.SampleKey`): admission after
a refusal a newer reading could change, a release's post-release sample, a held job's
server watch, the learner, the lendability probe's connection check.

:class:`OnDemandSamples` is the store's (``SharedState.samples``); the store tells it of
each sample it records (:meth:`OnDemandSamples.observed`). Event-loop only.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from vacancyd.core.observations import SampleKey


class OnDemandSamples:
    """Wakes collectors for samples now and waits for them.

    ``clock``: monotonic seconds (the store's). ``observed_at(key)``: when the newest sample
    of ``key`` was taken (monotonic s), or None.
    """

    def __init__(
        self, clock: Callable[[], float], observed_at: Callable[[SampleKey], float | None]
    ) -> None:
        self.clock = clock
        self._observed_at = observed_at
        self._wanted: dict[SampleKey, asyncio.Event] = {}
        #: Keys whose on-demand samples are taken on the loop itself (see :meth:`inline`).
        self._inline: dict[SampleKey, Callable[[], None]] = {}
        self._inline_due: set[SampleKey] = set()
        #: When each key's sample was last asked for (monotonic s).
        self._requested_at: dict[SampleKey, float] = {}
        self._observed: dict[SampleKey, asyncio.Event] = {}

    def wanted(self, key: SampleKey) -> asyncio.Event:
        """The event a collector waits on (besides its timer) to sample ``key`` at once."""
        return self._wanted.setdefault(key, asyncio.Event())

    def inline(self, key: SampleKey, sample: Callable[[], None]) -> None:
        """Take ``key``'s on-demand samples on the event loop: ``sample()`` (which probes and
        records the reading) runs in a loop callback soon after :meth:`request`.

        Only for a probe that cannot block: one that reads kernel memory through procfs
        (``/proc/meminfo``), never a device driver (NVML stays in its thread). Requests made
        before the callback runs share it: the sample it takes starts after all of them.
        """
        self._inline[key] = sample

    def request(self, key: SampleKey) -> None:
        """Wake ``key``'s collector for a sample now (a probe that starts after this call)."""
        if key in self._inline:
            self._requested_at[key] = self.clock()
            if key not in self._inline_due:
                self._inline_due.add(key)
                asyncio.get_running_loop().call_soon(self._sample_inline_now, key)
            return
        event = self._wanted.get(key)
        if event is not None:
            self._requested_at[key] = self.clock()
            event.set()

    def _sample_inline_now(self, key: SampleKey) -> None:
        self._inline_due.discard(key)
        self._inline[key]()

    def observed(self, key: SampleKey) -> None:
        """A sample of ``key`` was recorded: wake whoever waits in :meth:`fresh`."""
        event = self._observed.get(key)
        if event is not None:
            event.set()

    async def fresh(self, key: SampleKey, timeout_s: float, *, after: float | None = None) -> bool:
        """Wait for a sample of ``key`` (a capacity or a server observation) newer than needed.

        Without ``after``: one started after this call (a probe already running does not
        count), asked for now. With ``after`` (monotonic s): one started later than that;
        when a sample was already asked for at or after ``after`` (a release asks for one,
        so the next request's post-completion check finds it under way or done), that one
        is waited for instead of asking again.

        Returns False when none arrived within ``timeout_s`` seconds or nobody samples it.
        """
        if key not in self._wanted and key not in self._inline:
            return False
        since = self.clock() if after is None else after

        def arrived() -> bool:
            last = self._observed_at(key)
            if last is None:
                return False
            return last >= since if after is None else last > since

        if after is not None and arrived():
            return True
        observed = self._observed.setdefault(key, asyncio.Event())
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    observed.clear()
                    if after is None or self._requested_at.get(key, -math.inf) < since:
                        self.request(key)
                    await observed.wait()
                    if arrived():
                        return True
        except TimeoutError:
            return False
