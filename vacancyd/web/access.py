"""Access lines: one shape for every listener, and refusals summed up under a flood.

Every listener (the API and each proxy or pool listener) writes its access lines at INFO on
the logger ``vacancyd.access.LISTENER``, after the response has ended, in one shape::

    127.0.0.1 "POST /v1/chat/completions HTTP/1.1" 503 402 0.002s class=work \
        reason=lending_disabled borrower=friend

(one line; broken here to fit).

client, request line, status, bytes sent (head and body), duration in seconds (wall clock,
from the first byte of the request to the end of the response), route class, refusal
reason (``-`` when none) and borrower (its ``[[borrower]]`` name, ``default`` for the
unnamed borrower, ``-`` on the API's lines and for a request not allowed to borrow).
Structured fields, in this order, for ``--log-format json``: :data:`FIELDS`. The API's
lines have the route class ``api``.

Refusals are where a flood comes from (a borrower retrying at once, a pool without
backoff), and one line each would make the log the flood's most expensive part and bury
everything else in the journal. :class:`RefusalLog` keeps the first refusal of each
(listener, reason, borrower) in a window of :data:`WINDOW_S` seconds as a full line and
counts the rest, then writes one summary line per (listener, reason, borrower) with that
count, how many clients sent them and the busiest one. Every refusal is therefore either
a line of its own or counted in a summary that names its reason; admitted and other
requests keep one line each. While the access logger is at DEBUG (the debug window) every
refusal gets its line.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import ClassVar

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

#: The structured fields of an access line, in the order they are written.
FIELDS = (
    "listener",
    "client",
    "method",
    "path",
    "http_version",
    "status",
    "bytes",
    "duration_s",
    "route_class",
    "reason",
    "borrower",
)

#: The structured fields of a refusal summary line, in the order they are written.
SUMMARY_FIELDS = (
    "listener",
    "reason",
    "borrower",
    "status",
    "count",
    "window_s",
    "clients",
    "top_client",
)

#: Seconds one refusal window lasts, from the first refusal of its (listener, reason).
WINDOW_S = 1.0
#: Distinct clients counted per window; more are counted together and not named.
MAX_CLIENTS = 256

#: The route class of the API listener's lines.
API_CLASS = "api"

_TEXT = '%s "%s %s HTTP/%d.%d" %d %d %.3fs class=%s reason=%s borrower=%s'


def write_line(
    logger: logging.Logger,
    listener: str,
    request: web.BaseRequest,
    response: web.StreamResponse,
    duration_s: float,
    route_class: str,
    reason: str | None,
    borrower: str | None = None,
) -> None:
    """One access line at INFO on ``logger`` (the caller checked that INFO is enabled).
    ``borrower``: as shown (a name or ``default``), None for ``-``."""
    version = request.version
    http_version = f"{version.major}.{version.minor}"
    logger.info(
        _TEXT,
        request.remote,
        request.method,
        request.path_qs,
        version.major,
        version.minor,
        response.status,
        response.body_length,
        duration_s,
        route_class,
        reason or "-",
        borrower or "-",
        extra={
            "listener": listener,
            "client": request.remote,
            "method": request.method,
            "path": request.path_qs,
            "http_version": http_version,
            "status": response.status,
            "bytes": response.body_length,
            "duration_s": round(duration_s, 6),
            "route_class": route_class,
            "reason": reason,
            "borrower": borrower,
        },
    )


@dataclass(slots=True)
class _Window:
    logger: logging.Logger
    status: int
    count: int = 0  #: refusals after the first, not logged on a line of their own
    clients: dict[str, int] = field(default_factory=dict)
    unnamed: int = 0  #: of ``count``, those from clients beyond MAX_CLIENTS


class RefusalLog:
    """Refusal lines per (listener, reason, borrower): the first of a window in full, the
    rest counted.

    Loop-owned (called from aiohttp's access logging, on the event loop; no lock). A window
    opens at a (listener, reason, borrower)'s first refusal and is summed up
    :data:`WINDOW_S` seconds later by a loop timer, or by :meth:`flush` (the daemon calls it
    when it stops).
    """

    def __init__(self, window_s: float | None = None) -> None:
        """``window_s``: seconds a window lasts (None: :data:`WINDOW_S`)."""
        self.window_s = WINDOW_S if window_s is None else window_s
        self._open: dict[tuple[str, str, str], _Window] = {}
        self._timer: asyncio.TimerHandle | None = None

    def first(
        self,
        logger: logging.Logger,
        listener: str,
        reason: str,
        status: int,
        client: str | None,
        borrower: str = "-",
    ) -> bool:
        """True when this refusal gets a full line (the first of its (listener, reason,
        borrower) in the window, or no event loop runs to sum the rest up); False when it was
        counted into the window's summary instead. ``borrower``: as shown, ``-`` for none."""
        key = (listener, reason, borrower)
        window = self._open.get(key)
        if window is None:
            if self._timer is None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    return True
                self._timer = loop.call_later(self.window_s, self.flush)
            self._open[key] = _Window(logger, status)
            return True
        window.count += 1
        name = client or "-"
        clients = window.clients
        seen = clients.get(name)
        if seen is not None:
            clients[name] = seen + 1
        elif len(clients) < MAX_CLIENTS:
            clients[name] = 1
        else:
            window.unnamed += 1
        return False

    def flush(self) -> None:
        """Write the summary of every open window with refusals beyond its first, and close
        them all (the next refusal of each opens a new window with a full line)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        windows, self._open = self._open, {}
        for (listener, reason, borrower), w in windows.items():
            if not w.count:
                continue
            top, top_n = max(w.clients.items(), key=lambda kv: kv[1], default=("-", 0))
            clients = len(w.clients) + (1 if w.unnamed else 0)
            more = "+" if w.unnamed else ""
            w.logger.info(
                "%d more refusals (reason=%s, borrower=%s, status %d) within %.1fs from %d%s "
                "clients; most from %s (%d)",
                w.count,
                reason,
                borrower,
                w.status,
                self.window_s,
                clients,
                more,
                top,
                top_n,
                extra={
                    "listener": listener,
                    "reason": reason,
                    "borrower": None if borrower == "-" else borrower,
                    "status": w.status,
                    "count": w.count,
                    "window_s": self.window_s,
                    "clients": clients,
                    "top_client": top,
                },
            )


class AccessLogger(AbstractAccessLogger):
    """aiohttp access logger for the API listener: one line per request in the shape of
    :func:`write_line`, route class ``api``."""

    __slots__ = ()

    listener: ClassVar[str] = "api"

    @classmethod
    def bind(cls, listener: str) -> type[AccessLogger]:
        """A subclass writing ``listener`` into its lines' structured fields."""
        return type("AccessLogger", (cls,), {"listener": listener, "__slots__": ()})

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        write_line(self.logger, self.listener, request, response, time, API_CLASS, None)
