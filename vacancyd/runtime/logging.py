"""Logging setup: plain text by default, one JSON object per line with ``--log-format json``."""

from __future__ import annotations

import logging
import sys


def configure(level: str = "info", fmt: str = "plain") -> None:
    """Configure the root logger. Raises ValueError for an unknown level or format."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        try:
            from pythonjsonlogger.json import JsonFormatter
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise ValueError(
                "--log-format json needs the json-logs extra: pip install 'vacancyd[json-logs]'"
            ) from exc
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
    logging.getLogger("aiohttp.access").setLevel(max(numeric, logging.INFO))
