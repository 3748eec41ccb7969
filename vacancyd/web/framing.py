"""Whether aiohttp parses HTTP with its compiled parser (llhttp), which every listener needs.

aiohttp falls back to a pure-Python parser when its C extensions are missing (no wheel for
the platform, a build without a compiler) or switched off (``AIOHTTP_NO_EXTENSIONS=1``).
That parser is lenient where llhttp is strict: it takes ``Transfer-Encoding: chunked,
chunked`` and other ambiguous framing that llhttp answers with 400. A reverse proxy that
frames a request differently from the server behind it (or from a balancer in front of it)
can be made to smuggle one request inside another, so the daemon refuses to start on the
lenient parser (docs/configuration.md, THREAT_MODEL.md).
"""

from __future__ import annotations

import os

from aiohttp import http_parser


def lenient_parser_problem() -> str | None:
    """None when aiohttp parses requests and replies with its compiled parser; otherwise
    what is wrong and how to fix it, as one sentence for the log."""
    compiled = getattr(http_parser, "HttpRequestParserC", None)
    if compiled is not None and http_parser.HttpRequestParser is compiled:
        return None
    why = (
        "AIOHTTP_NO_EXTENSIONS is set"
        if os.environ.get("AIOHTTP_NO_EXTENSIONS")
        else "its C extensions are not installed for this platform"
    )
    return (
        "aiohttp would parse HTTP with its pure-Python parser because "
        f"{why}; that parser accepts ambiguous request framing (such as "
        "'Transfer-Encoding: chunked, chunked') that its compiled parser refuses, which lets a "
        "request be smuggled past vacancyd's gate, so vacancyd does not start on it; unset "
        "AIOHTTP_NO_EXTENSIONS, or install aiohttp with its compiled extensions (a wheel for "
        "this platform, or a build with a C compiler)"
    )
