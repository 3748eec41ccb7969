"""Scoped bearer authentication (docs/architecture.md and "API and metrics").

Scopes: ``borrow`` (proxy work and pass-through routes), ``read`` (/status, /metrics),
``admin`` (runtime switches; implies ``read``). With ``trust_loopback`` a client connecting
from a loopback address is the owner and holds every scope. Every decision is counted in
``vacancyd_auth_total{scope,outcome}``.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from dataclasses import dataclass

from aiohttp import web

from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.core.refusal import error_body
from vacancyd.web.metrics import Metrics

#: Scopes a scope grants besides itself: the lendability probe reveals less than any.
IMPLIED = {"admin": {"read", "probe"}, "read": {"probe"}, "borrow": {"probe"}}


@dataclass(frozen=True, slots=True)
class Token:
    name: str
    secret: str
    scopes: frozenset[str]

    def grants(self, scope: str) -> bool:
        return scope in self.scopes or any(scope in IMPLIED.get(s, ()) for s in self.scopes)


def is_loopback_peer(request: web.BaseRequest) -> bool:
    peer = request.remote
    return bool(peer) and _is_loopback_address(peer)


@functools.lru_cache(maxsize=1024)
def _is_loopback_address(peer: str) -> bool:
    """Parsing an address costs more than the rest of a refusal; peers repeat, so remember."""
    try:
        return ipaddress.ip_address(peer.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class Authenticator:
    def __init__(self, tokens: list[Token], *, trust_loopback: bool, metrics: Metrics) -> None:
        self._secrets = [(token, token.secret.encode()) for token in tokens]
        self._trust_loopback = trust_loopback
        self._metrics = metrics

    def check(
        self, request: web.BaseRequest, scope: str, *, record: bool = True
    ) -> web.Response | None:
        """None when ``request`` holds ``scope``; else the 401/403 JSON response to send.

        ``record=False`` leaves ``vacancyd_auth_total`` alone (a look-ahead that the real
        check will repeat).
        """
        if self._trust_loopback and is_loopback_peer(request):
            self._record(record, scope, "allowed")
            return None
        header = request.headers.get("Authorization", "")
        kind, _, presented = header.partition(" ")
        if kind.lower() != "bearer" or not presented.strip():
            self._record(record, scope, "missing")
            return web.json_response(
                error_body(
                    "authentication required: send Authorization: Bearer <token>",
                    ErrorType.AUTHENTICATION,
                    ErrorCode.MISSING_TOKEN,
                ),
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="vacancyd"'},
            )
        # Header values arrive decoded with surrogateescape; bytes that are not UTF-8 must
        # compare as bytes (and never match), not raise.
        presented_bytes = presented.strip().encode("utf-8", "surrogateescape")
        match = None
        for token, secret in self._secrets:
            if hmac.compare_digest(secret, presented_bytes):
                match = token
        if match is None:
            self._record(record, scope, "invalid")
            return web.json_response(
                error_body(
                    "the bearer token is not valid",
                    ErrorType.AUTHENTICATION,
                    ErrorCode.INVALID_TOKEN,
                ),
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="vacancyd", error="invalid_token"'},
            )
        if not match.grants(scope):
            self._record(record, scope, "forbidden")
            return web.json_response(
                error_body(
                    f"token {match.name!r} lacks the {scope!r} scope",
                    ErrorType.PERMISSION,
                    ErrorCode.INSUFFICIENT_SCOPE,
                ),
                status=403,
            )
        self._record(record, scope, "allowed")
        return None

    def _record(self, record: bool, scope: str, outcome: str) -> None:
        if record:
            self._metrics.auth(scope, outcome)
