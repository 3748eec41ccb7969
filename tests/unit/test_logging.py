"""Log hygiene: malformed requests (anyone can send them) are one WARNING line, not an
ERROR with a traceback; other errors keep their traceback."""

from __future__ import annotations

import logging
import sys

from aiohttp.http_exceptions import LineTooLong

from vacancyd.runtime.logging import MalformedRequestFilter


def record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord(
        "aiohttp.server",
        logging.ERROR,
        __file__,
        1,
        "Error handling request from %s",
        ("10.0.0.9",),
        info,
    )


def test_malformed_request_becomes_one_warning_line() -> None:
    rec = record(LineTooLong("x" * 10, "8190", "9000"))
    assert MalformedRequestFilter().filter(rec)
    assert rec.levelno == logging.WARNING and rec.exc_info is None
    message = rec.getMessage()
    assert message.startswith("Error handling request from 10.0.0.9: malformed request (")
    assert "8190" in message


def test_other_errors_keep_their_traceback() -> None:
    rec = record(RuntimeError("bug"))
    assert MalformedRequestFilter().filter(rec)
    assert rec.levelno == logging.ERROR and rec.exc_info is not None
