"""Header rules for forwarding (docs/architecture.md). Pure functions.

Dropped in both directions: hop-by-hop headers (RFC 9110 §7.6.1), every header named in
``Connection``, and ``Proxy-*``. Towards the upstream also ``Host`` (replaced by the
upstream's own authority: Ollama and llama-server bound to loopback reject foreign hosts),
``Origin`` (ComfyUI's origin guard answers 403 when it differs), ``Expect``, the body
framing headers (the proxy re-frames the body) and ``Content-Encoding`` (the body arrives
decoded), and the borrower's ``Authorization`` unless
the upstream forwards it.
"""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
#: aiohttp decodes request bodies (gzip, deflate, br, zstd) before the proxy reads them, so
#: the forwarded body is never encoded: its Content-Encoding must not travel with it.
REQUEST_DROP = frozenset({"host", "origin", "expect", "content-length", "content-encoding"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def _connection_named(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    named: set[str] = set()
    for value in headers.getall("Connection", []):
        named.update(token.strip().lower() for token in value.split(",") if token.strip())
    return named


def _keep(name: str, named: set[str]) -> bool:
    lower = name.lower()
    return lower not in HOP_BY_HOP and lower not in named and not lower.startswith("proxy-")


def request_headers(
    incoming: CIMultiDictProxy[str],
    *,
    target: URL,
    forward_authorization: bool,
    credential: str | None,
) -> CIMultiDict[str]:
    """Headers to send upstream for a borrower's request."""
    named = _connection_named(incoming)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lower = name.lower()
        if not _keep(name, named) or lower in REQUEST_DROP:
            continue
        if lower == "authorization" and not forward_authorization:
            continue
        out.add(name, value)
    host = target.raw_host or ""
    if ":" in host:
        host = f"[{host}]"
    out["Host"] = host if target.is_default_port() else f"{host}:{target.port}"
    if credential is not None:
        out["Authorization"] = f"Bearer {credential}"
    return out


def response_headers(
    incoming: CIMultiDictProxy[str], *, target: URL, drop: Iterable[str] = ()
) -> CIMultiDict[str]:
    """Headers to return to the borrower; a ``Location`` naming the upstream is made relative."""
    named = _connection_named(incoming) | {d.lower() for d in drop}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        if not _keep(name, named):
            continue
        if name.lower() == "location":
            value = rewrite_location(value, target)
        out.add(name, value)
    return out


def rewrite_location(value: str, target: URL) -> str:
    """Turn an absolute Location on the upstream's own address into a path on the proxy."""
    try:
        url = URL(value)
    except ValueError:
        return value
    if not url.is_absolute():
        return value
    same_port = url.port == target.port
    host = (url.raw_host or "").lower()
    if same_port and (host == (target.raw_host or "").lower() or host in LOOPBACK_NAMES):
        return str(url.relative())
    return value
