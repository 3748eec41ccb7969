"""Scoped bearer authentication and the browser guards (docs/architecture.md, THREAT_MODEL.md).

Scopes: ``borrow`` (proxy work and pass-through routes), ``read`` (/status, /metrics),
``admin`` (runtime switches; implies ``read``). With ``trust_loopback`` a client connecting
from a loopback address is the owner and holds every scope, unless the request carries
forwarding headers (:data:`FORWARDING_HEADERS`): then a proxy on this host relayed it for a
client that may be anywhere, and it is trusted only when that proxy's address is one of
``trusted_proxies`` and the client it names is on loopback too. A request with more than
one ``Authorization`` header is refused (400) whatever else it carries; with
``allow_unauthenticated_remote`` a client without a token holds ``borrow``. Every decision is
counted in ``vacancyd_auth_total{scope,outcome}``.

Borrowers (docs/borrowers.md). Every allowed request is some borrower's: a request that
presents a ``[[borrower]]``'s token is that named borrower wherever it comes from (a trusted
loopback client included: its token, not its position, decides, so it holds only
``borrow``); any other allowed request (a ``[[server.tokens]]`` token, a trusted loopback
client without a borrower's token, an unauthenticated borrower) is the unnamed borrower
``""`` (:data:`UNNAMED_BORROWER`). :meth:`Authenticator.check` stores the name under
:data:`BORROWER` on the request; :meth:`Authenticator.borrower` reads it.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDictProxy

from vacancyd.core.reasons import AuthOutcome, ErrorCode, ErrorType, GuardReason
from vacancyd.core.refusal import error_body
from vacancyd.core.usage import UNNAMED
from vacancyd.web.logins import SESSION_SCOPES, Logins
from vacancyd.web.metrics import Metrics
from vacancyd.web.site import mark_authenticated

#: Scopes a scope grants besides itself: the lendability probe reveals less than any.
IMPLIED = {"admin": {"read", "probe"}, "read": {"probe"}, "borrow": {"probe"}}
#: The unnamed borrower's name in code (shown as ``UNNAMED_LABEL``, "default").
UNNAMED_BORROWER = UNNAMED
#: Which borrower an allowed request is (a ``[[borrower]]`` name, or ``""``).
BORROWER: web.RequestKey[str] = web.RequestKey("vacancyd.borrower", str)
#: The scopes a ``[[borrower]]`` token grants.
BORROWER_SCOPES = frozenset({"borrow"})


@dataclass(frozen=True, slots=True)
class Token:
    """A bearer token. ``borrower``: the ``[[borrower]]`` it names (``""``: a
    ``[[server.tokens]]`` token, whose holder is the unnamed borrower)."""

    name: str
    secret: str
    scopes: frozenset[str]
    borrower: str = UNNAMED

    def grants(self, scope: str) -> bool:
        return scope in self.scopes or any(scope in IMPLIED.get(s, ()) for s in self.scopes)


def borrower_token(name: str, secret: str) -> Token:
    """The token of the ``[[borrower]]`` called ``name``: it grants ``borrow`` (and so the
    probe) and names its borrower."""
    return Token(name, secret, BORROWER_SCOPES, borrower=name)


def is_loopback_peer(request: web.BaseRequest) -> bool:
    """Whether the TCP peer is on a loopback address (who relayed the request, not who sent
    it: see :meth:`Authenticator.loopback_client`)."""
    peer = request.remote
    return bool(peer) and _is_loopback_address(peer)


#: Request headers by which a proxy names the client it relays for (lowercase).
CLIENT_ADDRESS_HEADERS = frozenset(
    {
        "forwarded",
        "x-forwarded-for",
        "x-real-ip",
        "x-client-ip",
        "true-client-ip",
        "cf-connecting-ip",
        "fastly-client-ip",
        "client-ip",
        "x-cluster-client-ip",
        "x-original-forwarded-for",
    }
)
#: Request headers that say a proxy relayed the request (lowercase; every ``X-Forwarded-*``
#: header counts too).
FORWARDING_HEADERS = CLIENT_ADDRESS_HEADERS | {"via"}


def is_forwarding_header(name: str) -> bool:
    """Whether the header ``name`` (any case) says a proxy relayed the request."""
    lower = name.lower()
    return lower in FORWARDING_HEADERS or lower.startswith("x-forwarded-")


def _forwarded_for(value: str) -> list[str]:
    """The ``for=`` nodes of a ``Forwarded`` value (RFC 7239), in order, unquoted and without
    brackets or port ("unknown" and obfuscated nodes stay as they are)."""
    nodes: list[str] = []
    for element in value.split(","):
        for pair in element.split(";"):
            key, _, node = pair.strip().partition("=")
            if key.strip().lower() == "for":
                node = node.strip().strip('"')
                if node.startswith("["):
                    node = node[1 : node.find("]")] if "]" in node else node[1:]
                elif node.count(":") == 1:
                    node = node.split(":", 1)[0]
                nodes.append(node)
    return nodes


def relayed_clients(
    headers: Mapping[str, str] | CIMultiDictProxy[str],
    trusted: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network],
) -> list[str | None]:
    """The client each client-address header of a relayed request names, one entry per
    header that names any: for ``X-Forwarded-For`` (all its lines) and ``Forwarded``'s
    ``for=`` nodes the right-most address not itself in ``trusted`` (the left-most when all
    are), for a single-address header such as ``X-Real-IP`` its address. An entry is None
    when a node is not an address. Empty when no header names a client.

    Every header is read, not only the first present: a proxy overwrites the header it
    sets and may pass the others through from its client as they came, so any one of them
    may be the client's own claim."""
    getall = getattr(headers, "getall", None)

    def values(name: str) -> list[str]:
        if getall is not None:
            return list(getall(name, []))
        value = headers.get(name)
        return [] if value is None else [value]

    chains = [
        [n.strip() for v in values("X-Forwarded-For") for n in v.split(",") if n.strip()],
        [n for v in values("Forwarded") for n in _forwarded_for(v)],
    ]
    for name in sorted(CLIENT_ADDRESS_HEADERS - {"forwarded", "x-forwarded-for"}):
        chains.append([v.strip() for v in values(name) if v.strip()])
    nets = tuple(trusted)
    clients: list[str | None] = []
    for chain in chains:
        if chain:
            clients.append(_chain_client(chain, nets))
    return clients


def _chain_client(
    chain: list[str], nets: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
) -> str | None:
    """The right-most address of ``chain`` not in ``nets`` (the left-most when all are);
    None when a node is not an address."""
    addresses = []
    for node in chain:
        try:
            addresses.append(ipaddress.ip_address(node.split("%", 1)[0]))
        except ValueError:
            return None
    for address in reversed(addresses):
        if not any(address in net for net in nets):
            return str(address)
    return str(addresses[0])


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
        trusted_proxies: Iterable[str] = (),
    ) -> None:
        """``trusted_proxies``: addresses or networks (``127.0.0.1``, ``10.0.0.0/8``) of
        proxies whose client-address headers are believed; raises ``ValueError`` for an
        entry that is neither."""
        self._tokens = tokens
        #: Sessions of the status page opened through ``vacancyd open`` (read scope only).
        self.logins = logins
        self._secrets = [(token, token.secret.encode()) for token in tokens]
        #: The ``[[borrower]]`` tokens: presenting one overrides trust by position.
        self._named = [(token, secret) for token, secret in self._secrets if token.borrower]
        self._trust_loopback = trust_loopback
        self._allow_unauthenticated = allow_unauthenticated_remote
        self._metrics = metrics
        self._server_names = frozenset(host_name(n) for n in server_names)
        self._origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self._hosts: dict[str, bool] = {}
        self._proxies = tuple(ipaddress.ip_network(p, strict=False) for p in trusted_proxies)

    def loopback_client(self, request: web.BaseRequest) -> bool:
        """Whether the client that sent ``request`` is on this host: the TCP peer is on
        loopback and either no forwarding header says a proxy relayed the request, or the
        peer is one of ``trusted_proxies`` and every client-address header it sent names a
        client on loopback (one naming a remote client or no address makes it remote)."""
        if not is_loopback_peer(request):
            return False
        headers = request.headers
        if not any(is_forwarding_header(name) for name in headers):
            return True
        peer = ipaddress.ip_address((request.remote or "").split("%", 1)[0])
        if not any(peer in net for net in self._proxies):
            return False
        clients = relayed_clients(headers, self._proxies)
        return bool(clients) and all(c is not None and _is_loopback_address(c) for c in clients)

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
        if self._trust_loopback and self.loopback_client(request):
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
        if len(request.headers.getall("Authorization", ())) > 1:
            self._record(record, scope, AuthOutcome.DUPLICATE)
            return web.json_response(
                error_body(
                    "more than one Authorization header: send exactly one",
                    ErrorType.INVALID_REQUEST,
                    ErrorCode.DUPLICATE_AUTHORIZATION,
                ),
                status=400,
            )
        trusted = self._position_trusted(request, scope)
        if trusted and self._named and self._presented_borrower(request) is not None:
            trusted = None  # a borrower's token makes it that borrower, wherever it is from
        if trusted:
            self._record(record, scope, AuthOutcome.ALLOWED)
            mark_authenticated(request)
            request[BORROWER] = UNNAMED
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
        request[BORROWER] = match.borrower
        return None

    def borrower(self, request: web.BaseRequest) -> str:
        """Which borrower ``request`` is: the ``[[borrower]]`` name its token names, else
        ``""`` (the unnamed borrower). Meaningful once :meth:`check` allowed it; ``""``
        before."""
        name = request.get(BORROWER)
        return name if isinstance(name, str) else UNNAMED

    def _presented_borrower(self, request: web.BaseRequest) -> str | None:
        """The ``[[borrower]]`` whose token ``request`` presents (``Authorization: Bearer``),
        else None."""
        header = request.headers.get("Authorization")
        if header is None:
            return None
        kind, _, presented = header.partition(" ")
        if kind.lower() != "bearer":
            return None
        presented_bytes = presented.strip().encode("utf-8", "surrogateescape")
        found = None
        for token, secret in self._named:
            if hmac.compare_digest(secret, presented_bytes):
                found = token.borrower
        return found

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
        return self._trust_loopback and self.loopback_client(request)

    def _guard_refusal(self, code: ErrorCode, message: str) -> web.Response:
        self._metrics.request_guard.labels(GuardReason(code.value)).inc()
        return _forbidden(message, code)

    def _record(self, record: bool, scope: str, outcome: AuthOutcome) -> None:
        if record:
            self._metrics.auth(scope, outcome)
