"""Logging setup: plain text by default, one JSON object per line with ``--log-format json``.

Timestamps are RFC 3339 in UTC with milliseconds (``2026-12-02T07:01:02.123Z``) in both
formats. JSON lines carry ``asctime``, ``level``, ``name``, ``message`` and any structured
fields a record was logged with (an access line adds :data:`vacancyd.web.access.FIELDS`).
"""

from __future__ import annotations

import logging
import sys
import time

from aiohttp.http_exceptions import HttpProcessingError
from pythonjsonlogger.json import JsonFormatter


class MalformedRequestFilter(logging.Filter):
    """aiohttp logs each malformed request (an over-long line, a bad method, an undecodable
    body) at ERROR with a traceback; anyone who can connect can cause that. Keep one
    WARNING line naming the problem instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            detail = " ".join(str(exc.message).split())
            original = record.getMessage()
            record.msg = "%s: malformed request (%s)"
            record.args = (original, detail[:200])
            record.exc_info = None
            record.exc_text = None
            record.levelno = logging.WARNING
            record.levelname = "WARNING"
        return True


class Rfc3339:
    """Formatter mixin: ``asctime`` as RFC 3339 UTC with milliseconds,
    ``2026-12-02T07:01:02.123Z`` (``datefmt`` is ignored). The seconds part is kept per
    second, so a burst of lines formats it once."""

    _second: int = -1
    _prefix: str = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        if second != self._second:
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        return f"{self._prefix}.{int(record.msecs):03d}Z"


class TextFormatter(Rfc3339, logging.Formatter):
    """The plain format: ``TIME LEVEL NAME: MESSAGE``."""


class JsonLineFormatter(Rfc3339, JsonFormatter):
    """The JSON format: one object per line."""


def configure(level: str = "info", fmt: str = "plain") -> None:
    """Configure the root logger. Raises ValueError for an unknown level or format."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonLineFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level"},
            )
        )
    elif fmt == "plain":
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    else:
        raise ValueError(f"unknown log format {fmt!r} (plain or json)")
    # Neither format shows where a call was made from, nor the thread, process or task: not
    # collecting them saves about a fifth of every record's cost (the "Optimization" section
    # of Python's logging HOWTO names these switches), and the access line is written once
    # per request.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    if sys.version_info >= (3, 12):
        logging.logAsyncioTasks = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # Python warnings go through the same handler (and format) instead of bare stderr.
    logging.captureWarnings(True)
    logging.getLogger("aiohttp.access").setLevel(max(numeric, logging.INFO))
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestFilter) for f in server_log.filters):
        server_log.addFilter(MalformedRequestFilter())
