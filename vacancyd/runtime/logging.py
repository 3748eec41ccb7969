"""Logging setup: plain text by default, one JSON object per line with ``--log-format json``.

JSON lines carry ``asctime``, ``level``, ``name``, ``message`` and any structured fields a
record was logged with (the proxy access line adds ``upstream``, ``status``, ``duration_s``,
``route_class`` and ``reason``).
"""

from __future__ import annotations

import logging
import sys

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


def configure(level: str = "info", fmt: str = "plain") -> None:
    """Configure the root logger. Raises ValueError for an unknown level or format."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level"},
            )
        )
    elif fmt == "plain":
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    else:
        raise ValueError(f"unknown log format {fmt!r} (plain or json)")
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # Python warnings go through the same handler (and format) instead of bare stderr.
    logging.captureWarnings(True)
    logging.getLogger("aiohttp.access").setLevel(max(numeric, logging.INFO))
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestFilter) for f in server_log.filters):
        server_log.addFilter(MalformedRequestFilter())
