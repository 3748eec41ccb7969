"""Operator routes for troubleshooting: a temporary debug-logging window and a redacted
diagnostics bundle (admin scope).

``PUT /admin/debug`` with ``{"minutes": N}`` (0 < N <= 240, fractions allowed) raises the
root logger to DEBUG for N minutes, after which it falls back to the level the daemon was
started with by itself; ``{"minutes": 0}`` ends the window now. Answers the window's state:
``{"active": bool, "remaining_s": float | null, "level": "DEBUG" | ...}``.

``GET /admin/diagnostics`` answers one JSON document to attach to a bug report::

    {"generated_at": ISO-8601 wall time, "versions": {...}, "config": {...},
     "status": {... as GET /status ...}, "collector_errors": [{"source", "error", "age_s"}],
     "recent_events": [{"at": ISO-8601, "kind", ...payload}], "debug": {...}}

Secrets never appear in it: token and credential values are dropped from the config, and
every token, credential and logind session user name the daemon knows is replaced by
``[redacted]`` wherever it occurs in the text.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib.metadata
import json
import logging
import platform
import re
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

from vacancyd import __version__
from vacancyd.api.app import EXPECT_ADMIN
from vacancyd.api.status import StatusViews, render_status
from vacancyd.config.model import Settings
from vacancyd.core.events import PER_JOB_EVENTS, StateEvent
from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.core.refusal import error_body
from vacancyd.state import SharedState

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Scoped = Callable[[str, Handler], Handler]
Mutation = Callable[[Handler], Handler]

#: The longest debug window one request may open (minutes).
MAX_DEBUG_MINUTES = 240
#: State transitions kept for the diagnostics bundle.
RECENT_EVENTS = 200
REDACTED = "[redacted]"
PACKAGES = ("aiohttp", "pydantic", "prometheus-client", "psutil", "nvidia-ml-py", "dbus-fast")


class DebugWindow:
    """Root logger at DEBUG until a deadline (event-loop time), then back by itself."""

    def __init__(self) -> None:
        self._base: int | None = None
        self._until: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def open(self, minutes: float) -> None:
        loop = asyncio.get_running_loop()
        root = logging.getLogger()
        if self._base is None:
            self._base = root.level
        root.setLevel(logging.DEBUG)
        if self._timer is not None:
            self._timer.cancel()
        self._until = loop.time() + minutes * 60
        self._timer = loop.call_later(minutes * 60, self.close)
        log.warning("debug logging on for %g minute(s)", minutes)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._base is not None:
            logging.getLogger().setLevel(self._base)
            log.warning("debug logging off; back to %s", logging.getLevelName(self._base))
        self._base = None
        self._until = None

    def view(self) -> dict[str, object]:
        remaining = None
        if self._until is not None:
            remaining = round(max(0.0, self._until - asyncio.get_running_loop().time()), 1)
        return {
            "active": self._until is not None,
            "remaining_s": remaining,
            "level": logging.getLevelName(logging.getLogger().level),
        }


def _versions() -> dict[str, str]:
    found = {
        "vacancyd": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def redacted_config(settings: Settings) -> dict[str, Any]:
    """The settings as JSON with every secret value removed (file paths stay)."""
    doc = settings.model_dump(mode="json")
    for token in doc.get("server", {}).get("tokens", []):
        if token.get("token") is not None:
            token["token"] = REDACTED
    for upstream in doc.get("upstream", []):
        if upstream.get("credential") is not None:
            upstream["credential"] = REDACTED
    return doc


class Diagnostics:
    """Keeps recent state transitions and renders the bundle.

    ``secrets`` returns every secret string to scrub (tokens, credentials) and ``users`` the
    logind session user names seen so far; both are read when a bundle is made.
    """

    def __init__(
        self,
        state: SharedState,
        settings: Settings,
        *,
        started_at: float,
        secrets: Callable[[], Iterable[str]],
        users: Callable[[], Iterable[str]],
        views: StatusViews | None = None,
    ) -> None:
        self.state = state
        self.views = views
        self.settings = settings
        self.started_at = started_at
        self.secrets = secrets
        self.users = users
        self.debug = DebugWindow()
        self.events: deque[dict[str, object]] = deque(maxlen=RECENT_EVENTS)
        state.subscribe(self._record)

    def _record(self, event: StateEvent) -> None:
        if event.kind in PER_JOB_EVENTS:
            # one per borrowed request: a busy minute of them would leave no room for the
            # presence, veto, reclaim and hold changes the bundle is for (/events has them)
            return
        at = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        self.events.append({"at": at, "kind": event.kind, **event.payload()})

    def collector_errors(self) -> list[dict[str, object]]:
        state = self.state
        now = state.clock()
        errors: list[dict[str, object]] = []

        def add(source: str, error: str | None, failed_at: float | None) -> None:
            if error:
                age = None if failed_at is None else round(now - failed_at, 1)
                errors.append({"source": source, "error": error, "age_s": age})

        for name, obs in sorted(state.capacity.items()):
            add(f"capacity {name}", obs.error, obs.failed_at)
        for name, server in sorted(state.servers.items()):
            add(f"server {name}", server.error, server.failed_at)
        for name, ps in sorted(state.pressure.items()):
            add(f"pressure {name}", ps.reading.error, ps.reading.failed_at)
        reading = state.presence.reading
        add("presence", reading.error, reading.failed_at)
        return errors

    def bundle(self) -> str:
        """The bundle as JSON text, scrubbed of every known secret and user name."""
        doc = {
            "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "versions": _versions(),
            "config": redacted_config(self.settings),
            "status": render_status(self.state, self.started_at, self.views),
            "collector_errors": self.collector_errors(),
            "recent_events": list(self.events),
            "debug": self.debug.view(),
        }
        return scrub(json.dumps(doc, indent=1, default=str), self.secrets(), self.users())

    def install(self, app: web.Application, scoped: Scoped, mutation: Mutation) -> None:
        """Add ``PUT /admin/debug`` (admin scope and the browser guards every admin change
        gets) and ``GET /admin/diagnostics`` (admin scope)."""

        async def put_debug(request: web.Request) -> web.Response:
            try:
                payload = json.loads(await request.read() or b"null")
            except (ValueError, UnicodeDecodeError) as exc:
                return _bad(f"body is not valid JSON: {exc}")
            minutes = payload.get("minutes") if isinstance(payload, dict) else None
            if (
                not isinstance(payload, dict)
                or set(payload) != {"minutes"}
                or isinstance(minutes, bool)
                or not isinstance(minutes, int | float)
                or not 0 <= minutes <= MAX_DEBUG_MINUTES
            ):
                return _bad(f'body must be {{"minutes": N}} with 0 <= N <= {MAX_DEBUG_MINUTES}')
            if minutes == 0:
                self.debug.close()
            else:
                self.debug.open(float(minutes))
            log.info(
                "admin set the debug window to %g minute(s) (from %s)", minutes, request.remote
            )
            return web.json_response(self.debug.view())

        async def get_diagnostics(_: web.Request) -> web.Response:
            return web.Response(text=self.bundle(), content_type="application/json")

        app.router.add_put("/admin/debug", mutation(put_debug), expect_handler=app[EXPECT_ADMIN])
        app.router.add_get("/admin/diagnostics", scoped("admin", get_diagnostics))


def _bad(message: str) -> web.Response:
    return web.json_response(
        error_body(message, ErrorType.INVALID_REQUEST, ErrorCode.INVALID_BODY), status=400
    )


def scrub(text: str, secrets: Iterable[str], users: Iterable[str]) -> str:
    """``text`` with each secret (anywhere) and each user name (as a whole word) replaced."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
        text = text.replace(json.dumps(secret)[1:-1], REDACTED)  # as escaped inside JSON
    for user in sorted({u for u in users if u}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(user)}(?![\w.-])", REDACTED, text)
    return text
