"""Header rules for forwarding (docs/architecture.md). Pure functions over precomputed sets.

Dropped in both directions: hop-by-hop headers (RFC 9110 §7.6.1), every header named in
``Connection``, and ``Proxy-*``. Towards the upstream also ``Host`` (replaced by the
upstream's own authority: Ollama and llama-server bound to loopback reject foreign hosts),
``Origin`` (ComfyUI's origin guard answers 403 when it differs), ``Expect``, the body
framing headers (the proxy re-frames the body) and ``Content-Encoding`` (the body arrives
decoded), and the borrower's ``Authorization`` unless the upstream forwards it.

Client address headers (``Forwarded``, every ``X-Forwarded-*``, ``X-Real-IP``,
``X-Client-IP``, ``True-Client-IP``, ``CF-Connecting-IP`` and the others a proxy may use to
name its client: :data:`vacancyd.web.auth.FORWARDING_HEADERS`) follow the upstream's
``forwarded_headers`` policy: ``replace`` (default) drops what the borrower sent and states
the real peer; ``drop`` sends none; ``append`` keeps what came (for a lender behind a
trusted front proxy) and adds the peer. Headers that ask a server to act on another URL or
method than the request line's (``X-Original-URL``, ``X-Rewrite-URL``,
``X-HTTP-Method-Override`` and kin) are always dropped: the gate classified the request by
its request line, and an upstream that honoured them could run work through a pass-through
route.

Towards the borrower also ``Server``, ``X-Powered-By``, ``Alt-Svc``, ``Set-Cookie`` and every
``Access-Control-*`` header are dropped unless the upstream's ``pass_response_headers``
names them: the borrower talks to vacancyd, which neither sets cookies for the upstream nor
grants cross-origin access on its behalf. A URL naming the upstream's own address (any
loopback or wildcard form of it) in ``Location``, ``Content-Location``, ``Link`` or
``Refresh`` becomes a path on the proxy.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from vacancyd.web.auth import is_forwarding_header

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
#: Headers by which some servers and frameworks take the URL or method from a header
#: instead of the request line.
OVERRIDES = frozenset(
    {
        "x-original-url",
        "x-rewrite-url",
        "x-override-url",
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
        "x-original-method",
    }
)
REQUEST_DROP = (
    frozenset({"host", "origin", "expect", "content-length", "content-encoding"}) | OVERRIDES
)
RESPONSE_DROP = frozenset({"server", "x-powered-by", "alt-svc", "set-cookie", "set-cookie2"})
URL_HEADERS = frozenset({"location", "content-location"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_LINK_URL = re.compile(r"<([^>]*)>")
_REFRESH_URL = re.compile(r"(?i)(\burl\s*=\s*['\"]?)([^'\"\s;]+)")


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
    peer: str | None = None,
    forwarded: str = "replace",
    scheme: str = "http",
) -> CIMultiDict[str]:
    """Headers to send upstream for a borrower's request.

    ``peer``: the borrower's address; ``forwarded``: the ``forwarded_headers`` policy
    (``replace``, ``drop`` or ``append``); ``scheme``: how the borrower reached the proxy.
    """
    named = _connection_named(incoming)
    out: CIMultiDict[str] = CIMultiDict()
    keep_forwarding = forwarded == "append"
    for name, value in incoming.items():
        lower = name.lower()
        if not _keep(name, named) or lower in REQUEST_DROP:
            continue
        if lower == "authorization" and not forward_authorization:
            continue
        if not keep_forwarding and is_forwarding_header(lower):
            continue
        out.add(name, value)
    host = target.raw_host or ""
    if ":" in host:
        host = f"[{host}]"
    out["Host"] = host if target.is_default_port() else f"{host}:{target.port}"
    if credential is not None:
        out["Authorization"] = f"Bearer {credential}"
    if peer and forwarded != "drop":
        node = f'"[{peer}]"' if ":" in peer else peer
        prior_xff = out.popall("X-Forwarded-For", [])
        prior_fwd = out.popall("Forwarded", [])
        out["X-Forwarded-For"] = ", ".join([*prior_xff, peer])
        out["Forwarded"] = ", ".join([*prior_fwd, f"for={node};proto={scheme}"])
        if not keep_forwarding:
            out["X-Forwarded-Proto"] = scheme
    return out


def response_headers(
    incoming: CIMultiDictProxy[str],
    *,
    target: URL,
    drop: Iterable[str] = (),
    allow: frozenset[str] = frozenset(),
) -> CIMultiDict[str]:
    """Headers to return to the borrower (``allow``: lowercase names kept that would be
    dropped); URLs naming the upstream are made relative."""
    named = _connection_named(incoming) | {d.lower() for d in drop}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        if not _keep(name, named):
            continue
        lower = name.lower()
        if (lower in RESPONSE_DROP or lower.startswith("access-control-")) and lower not in allow:
            continue
        if lower in URL_HEADERS:
            value = rewrite_location(value, target)
        elif lower == "link":
            value = _LINK_URL.sub(lambda m: f"<{rewrite_location(m.group(1), target)}>", value)
        elif lower == "refresh":
            value = _REFRESH_URL.sub(
                lambda m: m.group(1) + rewrite_location(m.group(2), target), value
            )
        out.add(name, value)
    return out


def _names_upstream(host: str, target: URL) -> bool:
    """Whether ``host`` (lowercase, unbracketed) is the upstream or a loopback/wildcard
    form a server may use for itself."""
    if host == (target.raw_host or "").lower() or host in LOOPBACK_NAMES:
        return True
    if host.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback or addr.is_unspecified


def rewrite_location(value: str, target: URL) -> str:
    """Turn an absolute URL on the upstream's own address into a path on the proxy."""
    try:
        url = URL(value)
    except ValueError:
        return value
    if not url.is_absolute():
        return value
    host = (url.raw_host or "").lower().strip("[]")
    if url.port == target.port and _names_upstream(host, target):
        return str(url.relative())
    return value
