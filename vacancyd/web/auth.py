"""Scoped bearer authentication and the browser guards (docs/architecture.md, THREAT_MODEL.md).

Scopes: ``borrow`` (proxy work and pass-through routes), ``read`` (/status, /metrics),
``admin`` (runtime switches; implies ``read``). With ``trust_loopback`` a client connecting
from a loopback address is the owner and holds every scope; with
``allow_unauthenticated_remote`` a client without a token holds ``borrow``. Every decision is
counted in ``vacancyd_auth_total{scope,outcome}``.

Browser guards. A request trusted for where it comes from rather than for a secret it holds
can be sent by any web page the owner opens, so such a request must name this host in
``Host`` (a single-label name such as ``localhost``, an IP address, or one of
``server_names``): a DNS-rebinding page names its own domain (it needs a name whose DNS
answers it controls) and is refused with 403 ``host_not_allowed``. A bearer token cannot be
ridden this way (a page does not have it), so token-authenticated requests keep any Host.
Admin mutations additionally refuse (403) an ``Origin`` not in ``allowed_origins`` and
``Sec-Fetch-Site: cross-site``/``same-site``, and position-trusted ones must send a body (when
they have one) as ``Content-Type: application/json`` (415 otherwise), which a page cannot do
without a CORS preflight that vacancyd never grants. See THREAT_MODEL.md.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp import web

from vacancyd.core.reasons import AuthOutcome, ErrorCode, ErrorType, GuardReason
from vacancyd.core.refusal import error_body
from vacancyd.web.logins import SESSION_SCOPES, Logins
from vacancyd.web.metrics import Metrics
from vacancyd.web.site import mark_authenticated

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


def host_name(host_header: str) -> str:
    """The name part of a Host header value, lowercased, without port or brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


#: Host header values whose verdict is remembered per authenticator (then forgotten at once:
#: a borrower sends one or two, so only a client making them up fills it).
HOST_CACHE_SIZE = 256


@functools.lru_cache(maxsize=1024)
def _is_ip(name: str) -> bool:
    """Whether ``name`` is an IP literal (remembered: Host values repeat)."""
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    return True


#: Sec-Fetch-Site values a browser sends for a request the page's own site did not make.
FOREIGN_FETCH_SITES = frozenset({"cross-site", "same-site"})
#: Content types a page may send cross-origin without a CORS preflight.
JSON_TYPES = frozenset({"application/json"})
#: The ``WWW-Authenticate`` challenge of a 401 (RFC 6750).
CHALLENGE = 'Bearer realm="vacancyd"'


#: The two 401 bodies never vary, so each is serialized once (what ``web.json_response``
#: would send: the same JSON text, ``application/json; charset=utf-8``).
_MISSING_TOKEN = json.dumps(
    error_body(
        "authentication required: send Authorization: Bearer <token>",
        ErrorType.AUTHENTICATION,
        ErrorCode.MISSING_TOKEN,
    )
)
_INVALID_TOKEN = json.dumps(
    error_body("the bearer token is not valid", ErrorType.AUTHENTICATION, ErrorCode.INVALID_TOKEN)
)


def _unauthorized(text: str, challenge: str) -> web.Response:
    return web.Response(
        text=text,
        status=401,
        headers={"WWW-Authenticate": challenge},
        content_type="application/json",
    )


def _forbidden(message: str, code: ErrorCode) -> web.Response:
    return web.json_response(error_body(message, ErrorType.PERMISSION, code), status=403)


class Authenticator:
    def __init__(
        self,
        tokens: list[Token],
        *,
        trust_loopback: bool,
        metrics: Metrics,
        allow_unauthenticated_remote: bool = False,
        server_names: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        logins: Logins | None = None,
    ) -> None:
        self._tokens = tokens
        #: Sessions of the status page opened through ``vacancyd open`` (read scope only).
        self.logins = logins
        self._secrets = [(token, token.secret.encode()) for token in tokens]
        self._trust_loopback = trust_loopback
        self._allow_unauthenticated = allow_unauthenticated_remote
        self._metrics = metrics
        self._server_names = frozenset(host_name(n) for n in server_names)
        self._origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self._hosts: dict[str, bool] = {}

    def host_allowed(self, request: web.BaseRequest) -> bool:
        """Whether ``Host`` names this host: an IP literal, a single-label name (``localhost``,
        the machine's own name: a web page cannot make such a name resolve where it wants),
        a name under ``localhost``, or a configured ``server_names`` entry. A request without
        Host (HTTP/1.0, not a browser) passes."""
        header = request.headers.get("Host")
        if header is None:
            return True
        # Parsing an IP literal costs more than the rest of a refusal; Host values repeat.
        allowed = self._hosts.get(header)
        if allowed is None:
            name = host_name(header)
            allowed = (
                "." not in name
                or name in self._server_names
                or name.endswith(".localhost")
                or _is_ip(name)
            )
            if len(self._hosts) >= HOST_CACHE_SIZE:
                self._hosts.clear()
            self._hosts[header] = allowed
        return allowed

    def _position_trusted(self, request: web.BaseRequest, scope: str) -> bool | None:
        """True/False when the request is trusted for its position (and its Host passes or
        not); None when a token must decide."""
        has_auth = "Authorization" in request.headers
        if self._trust_loopback and is_loopback_peer(request):
            pass
        elif self._allow_unauthenticated and scope == "borrow" and not has_auth:
            pass
        else:
            return None
        if self.host_allowed(request):
            return True
        if has_auth:
            return None  # a token may still authenticate it
        return False

    def check(
        self, request: web.BaseRequest, scope: str, *, record: bool = True
    ) -> web.Response | None:
        """None when ``request`` holds ``scope``; else the 401/403 JSON response to send.

        ``record=False`` leaves ``vacancyd_auth_total`` alone (a look-ahead that the real
        check will repeat).
        """
        trusted = self._position_trusted(request, scope)
        if trusted:
            self._record(record, scope, AuthOutcome.ALLOWED)
            mark_authenticated(request)
            return None
        if trusted is False:
            self._record(record, scope, AuthOutcome.HOST_NOT_ALLOWED)
            if record:
                self._metrics.request_guard.labels(GuardReason.HOST_NOT_ALLOWED).inc()
            return _forbidden(
                f"Host {request.headers.get('Host', '')!r} does not name this lender; a request "
                "trusted without a token must use localhost, an IP address or one of "
                "server.server_names (a web page may be trying to reach this daemon)",
                ErrorCode.HOST_NOT_ALLOWED,
            )
        header = request.headers.get("Authorization", "")
        kind, _, presented = header.partition(" ")
        if kind.lower() != "bearer" or not presented.strip():
            self._record(record, scope, AuthOutcome.MISSING)
            return _unauthorized(_MISSING_TOKEN, CHALLENGE)
        # Header values arrive decoded with surrogateescape; bytes that are not UTF-8 must
        # compare as bytes (and never match), not raise.
        presented_bytes = presented.strip().encode("utf-8", "surrogateescape")
        match = None
        for token, secret in self._secrets:
            if hmac.compare_digest(secret, presented_bytes):
                match = token
        if match is None and self.logins is not None:
            if self.logins.session_valid(presented_bytes, time.monotonic()):
                match = Token("page session", "", SESSION_SCOPES)
        if match is None:
            self._record(record, scope, AuthOutcome.INVALID)
            # RFC 6750's error code for a bad token is the same string as ours.
            return _unauthorized(_INVALID_TOKEN, f'{CHALLENGE}, error="{ErrorCode.INVALID_TOKEN}"')
        if not match.grants(scope):
            self._record(record, scope, AuthOutcome.FORBIDDEN)
            return web.json_response(
                error_body(
                    f"token {match.name!r} lacks the {scope!r} scope",
                    ErrorType.PERMISSION,
                    ErrorCode.INSUFFICIENT_SCOPE,
                ),
                status=403,
            )
        self._record(record, scope, AuthOutcome.ALLOWED)
        mark_authenticated(request)
        return None

    def check_mutation(self, request: web.BaseRequest) -> web.Response | None:
        """The browser guards for an admin mutation (after :meth:`check` allowed it).

        None when it may proceed; else a 403 (foreign Origin or fetch site) or 415 (a body
        that is not JSON on a request trusted without a token) JSON response.
        """
        origin = request.headers.get("Origin")
        if origin is not None and origin.rstrip("/").lower() not in self._origins:
            return self._guard_refusal(
                ErrorCode.ORIGIN_NOT_ALLOWED,
                f"Origin {origin!r} may not change this lender (server.allowed_origins)",
            )
        site = request.headers.get("Sec-Fetch-Site", "").lower()
        if origin is None and site in FOREIGN_FETCH_SITES:
            return self._guard_refusal(
                ErrorCode.CROSS_SITE_REQUEST, f"a {site} browser request may not change this lender"
            )
        if "Authorization" in request.headers and not self._trust_loopback_only(request):
            return None
        ctype = request.headers.get("Content-Type")
        if request.body_exists and (
            (ctype or "").split(";", 1)[0].strip().lower() not in JSON_TYPES
        ):
            self._metrics.request_guard.labels(GuardReason.CONTENT_TYPE).inc()
            return web.json_response(
                error_body(
                    "admin requests must send their body as Content-Type: application/json",
                    ErrorType.INVALID_REQUEST,
                    ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                ),
                status=415,
            )
        return None

    def _trust_loopback_only(self, request: web.BaseRequest) -> bool:
        # a loopback request with a token header is still trusted for its position first
        return self._trust_loopback and is_loopback_peer(request)

    def _guard_refusal(self, code: ErrorCode, message: str) -> web.Response:
        self._metrics.request_guard.labels(GuardReason(code.value)).inc()
        return _forbidden(message, code)

    def _record(self, record: bool, scope: str, outcome: AuthOutcome) -> None:
        if record:
            self._metrics.auth(scope, outcome)
