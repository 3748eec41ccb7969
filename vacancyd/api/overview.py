"""``GET /overview`` (read scope): what the status page shows beside ``/status``, the 24-hour
timeline and today's totals per borrower (docs/observability.md, "Status page").

The answer is one JSON document::

    {"timeline": {"svg": "<svg ...>", "samples": 1440, "error": null},
     "today": {"day": "2026-12-02", "since_wall": 1764630000.0, "zone": "Europe/Berlin",
               "rows": [{"borrower": "alice", "label": "alice", "requests": 12,
                         "busy_s": 830.5, "prompt_tokens": 5120, "completion_tokens": 2210,
                         "energy_j": 41230.0}, ...],
               "error": null}}

``timeline.svg`` is drawn by :func:`vacancyd.core.timeline.render_timeline` from the
durable history (every text in it escaped, no style or script: it can go into the page
under its Content-Security-Policy); ``samples``: how many it was drawn from. ``today``:
the usage ledger's jobs that ended since the lender's local midnight, one row per borrower
(``borrower`` ``""`` is the unnamed one, ``label`` how it is shown). Either part's ``error``
says why it is missing (no ledger kept, a database that cannot be read): the other part is
still answered, and the answer is still 200.

The database reads run on the usage database's own thread and the drawing on a worker
thread, so the event loop never waits for either; a drawing is reused for
:data:`REDRAW_AFTER_S` seconds, so many open pages cost one.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from vacancyd.core.history import HistorySample
from vacancyd.core.timeline import SPAN_S, render_timeline
from vacancyd.core.usage import borrower_label

log = logging.getLogger(__name__)

#: A drawn timeline is served again for this long (seconds) before it is drawn anew.
REDRAW_AFTER_S = 10.0

Handler = Callable[[web.Request], Any]


class HistorySource(Protocol):
    async def history(self, since: float) -> list[HistorySample]:
        """Samples taken at or after ``since`` (wall s), oldest first; raises when the
        database cannot be read."""
        ...


class UsageTotals(Protocol):
    """One group of the usage ledger (``vacancyd.core.usage.UsageGroup``)."""

    @property
    def key(self) -> str | None: ...
    @property
    def requests(self) -> int: ...
    @property
    def busy_s(self) -> float: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def energy_j(self) -> float | None: ...


class UsageSource(Protocol):
    async def groups(self, since: float, by: str) -> Sequence[UsageTotals]:
        """The ledger's jobs that ended since ``since`` (wall s), grouped ``by``; raises
        when the ledger cannot be read."""
        ...


def local_midnight(now_wall: float, tz: dt.tzinfo) -> tuple[float, str]:
    """The wall time (s) of the start of ``now_wall``'s local day in ``tz``, and the day
    (``YYYY-MM-DD``)."""
    local = dt.datetime.fromtimestamp(now_wall, tz)
    midnight = dt.datetime.combine(local.date(), dt.time(), tzinfo=tz)
    return midnight.timestamp(), local.date().isoformat()


@dataclass
class Overview:
    """The route's sources: ``history`` and ``usage`` (None: not kept by this daemon),
    ``tz`` and ``zone_name`` for local time (the axis labels, today's midnight)."""

    history: HistorySource | None
    usage: UsageSource | None
    tz: dt.tzinfo
    zone_name: str
    wall_clock: Callable[[], float] = time.time
    _drawn: tuple[float, dict[str, object]] | None = field(default=None, init=False)
    _drawing: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    def install(self, app: web.Application, scoped: Callable[[str, Handler], Handler]) -> None:
        """Add ``GET /overview`` with the read scope."""
        app.router.add_get("/overview", scoped("read", self.get))

    async def get(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"timeline": await self.timeline(), "today": await self.today()},
            headers={"Cache-Control": "no-store"},
        )

    async def timeline(self) -> dict[str, object]:
        """``{"svg", "samples", "error"}`` (see the module's docstring)."""
        async with self._drawing:
            now = self.wall_clock()
            if self._drawn is not None and 0 <= now - self._drawn[0] < REDRAW_AFTER_S:
                return self._drawn[1]
            samples: list[HistorySample] = []
            error: str | None = None
            if self.history is None:
                error = "this daemon keeps no history"
            else:
                try:
                    samples = await self.history.history(now - SPAN_S - 3600)
                except Exception as exc:
                    log.warning("could not read the lender's history: %s", exc)
                    error = f"could not read the history: {exc}"
            svg = await asyncio.to_thread(
                render_timeline, samples, now_wall=now, tz=self.tz, zone_name=self.zone_name
            )
            drawn: dict[str, object] = {"svg": svg, "samples": len(samples), "error": error}
            self._drawn = (now, drawn)
            return drawn

    async def today(self) -> dict[str, object]:
        """``{"day", "since_wall", "zone", "rows", "error"}`` (see the module's docstring)."""
        since, day = local_midnight(self.wall_clock(), self.tz)
        answer: dict[str, object] = {
            "day": day,
            "since_wall": since,
            "zone": self.zone_name,
            "rows": [],
            "error": None,
        }
        if self.usage is None:
            answer["error"] = "this daemon keeps no usage ledger"
            return answer
        try:
            groups = await self.usage.groups(since, "borrower")
        except Exception as exc:
            log.warning("could not read today's usage: %s", exc)
            answer["error"] = f"could not read the usage ledger: {exc}"
            return answer
        answer["rows"] = [
            {
                "borrower": g.key or "",
                "label": borrower_label(g.key or ""),
                "requests": g.requests,
                "busy_s": round(g.busy_s, 3),
                "prompt_tokens": g.prompt_tokens,
                "completion_tokens": g.completion_tokens,
                "energy_j": None if g.energy_j is None else round(g.energy_j, 1),
            }
            for g in sorted(groups, key=lambda g: (-g.busy_s, g.key or ""))
        ]
        return answer
