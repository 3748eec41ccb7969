"""What every part of the proxy shares: the upstream it serves, its limits, caches and
error replies (:mod:`vacancyd.proxy.app` tells the order of a request)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import aiohttp
from aiohttp import web
from yarl import URL

from vacancyd.adapters.base import Adapter, Controller
from vacancyd.config.model import LimitsSettings, UpstreamSettings
from vacancyd.control.admission import Admission
from vacancyd.control.upstreamcalls import UpstreamCalls
from vacancyd.core.classify import Classification, Classifier
from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import ErrorCode, ErrorType, Reason, Refuse
from vacancyd.core.refusal import RenderedRefusal, error_body
from vacancyd.proxy import bodies, client, headers, reply, tunnel
from vacancyd.web.auth import Authenticator
from vacancyd.web.metrics import Metrics
from vacancyd.web.site import reset_connection

MIB = 1024 * 1024
#: Upstream URLs remembered per listener (oldest forgotten first).
URL_CACHE_SIZE = 256
#: Statuses whose responses carry no body (RFC 9110 §6.4.1): always streamed as they are.
NO_BODY_STATUSES = frozenset({204, 304})
#: Serialized refusal replies kept per listener (all forgotten at once when full).
TEMPLATE_CACHE_SIZE = 512


@dataclass(frozen=True)
class Upstream:
    """Everything the proxy needs about one ``[[upstream]]``."""

    settings: UpstreamSettings
    policy: UpstreamPolicy
    adapter: Adapter
    target: URL
    credential: str | None

    #: A pool's listener borrows its first member's settings under the pool's own name.
    alias: str | None = None

    @property
    def name(self) -> str:
        return self.alias or self.settings.name


def origin_form(raw_target: str) -> str:
    """The request target as path and query (RFC 9112 §3.2): an absolute-form target
    (``http://host/v1/models``, which servers must accept) loses its scheme and authority;
    the path stays exactly as sent, so classification sees what the borrower wrote."""
    scheme, sep, rest = raw_target.partition("://")
    if not sep or "/" in scheme or scheme.lower() not in ("http", "https"):
        return raw_target
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    tail = rest[cut:]
    return tail if tail.startswith("/") else "/" + tail


def json_error(
    status: int, message: str, type_: ErrorType, code: ErrorCode | Reason, **extra: Any
) -> web.Response:
    return web.json_response(error_body(message, type_, code, **extra), status=status)


class ProxyBase:
    """One upstream listener's settings, limits and caches, and the helpers every path of
    :class:`~vacancyd.proxy.handler.Proxy` shares (error replies, upstream headers and URLs)."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        admission: Admission,
        auth: Authenticator,
        metrics: Metrics,
        limits: LimitsSettings,
        session: aiohttp.ClientSession,
        controller: Controller | None = None,
        calls: UpstreamCalls | None = None,
        tunnels: tunnel.TunnelLimits | None = None,
        members: Mapping[str, Self] | None = None,
        upstream_client: client.UpstreamClient | None = None,
    ) -> None:
        self.upstream = upstream
        #: A pool's member proxies, first member first (``[[pool]]``); empty otherwise.
        self.members: Mapping[str, Self] = members or {}
        #: Every admission decision: the early refusal, the probe, the pool's choice, the
        #: full decision (vacancyd.control.admission).
        self.admission = admission
        #: Whom the early refusal asks about: this upstream, or a pool's members.
        self.admits: tuple[str, ...] = tuple(self.members) or (upstream.name,)
        self.controller = controller
        self.tunnels = tunnel.Tunnels(tunnels or tunnel.TunnelLimits())
        self.auth = auth
        self.metrics = metrics
        self.limits = limits
        self.session = session  # WebSocket tunnels
        #: Forwarded requests go through this pooled client (vacancyd.proxy.client).
        self.client = upstream_client or client.UpstreamClient(
            upstream.target.raw_host or "127.0.0.1",
            upstream.target.port or 80,
            connect_timeout_s=limits.upstream_connect_timeout_s,
        )
        self.budget = bodies.BodyBudget(limits.buffered_budget_mib * MIB)
        self.max_body = limits.max_request_body_mib * MIB
        self.max_passthrough_body = limits.max_passthrough_body_kib * 1024
        settings = upstream.settings
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in settings.allowed_origins)
        self.pass_response = frozenset(h.lower() for h in settings.pass_response_headers)
        self.classify = Classifier(upstream.adapter.table)
        #: The silence limit (seconds, None: none): no byte from the upstream for that long,
        #: counted from the end of the request body and paused while the borrower is not
        #: reading, gives a borrowed job up (held) and ends a pass-through request with 504
        #: (vacancyd.proxy.client).
        self.silence_s = settings.silence_limit
        self._urls: dict[tuple[str, str], URL] = {}
        #: The calls to the server when it must be woken before work (vLLM sleep mode; decided
        #: once: a runtime-checkable Protocol's isinstance costs more than the rest of the
        #: check), else None.
        self._waker: UpstreamCalls | None = (
            calls if calls is not None and calls.waker(upstream.name) else None
        )
        self._templates: dict[int, tuple[RenderedRefusal, reply.Template]] = {}
        self._last_refusal: tuple[Refuse, bool, reply.Template, str] | None = None

    def _flat(self, request: web.BaseRequest) -> bool:
        """Whether vacancyd's errors on this request take the server's flat native shape."""
        prefixes = self.upstream.adapter.flat_error_prefixes
        return bool(prefixes) and request.path.startswith(prefixes)

    def _json_error(
        self,
        request: web.BaseRequest,
        status: int,
        message: str,
        type_: ErrorType,
        code: ErrorCode | Reason,
        **extra: Any,
    ) -> web.Response:
        """:func:`json_error` in the shape the request's route speaks (:meth:`_flat`)."""
        body = error_body(message, type_, code, flat=self._flat(request), **extra)
        return web.json_response(body, status=status)

    # -- entry point ---------------------------------------------------------------------
    def _request_headers(self, request: web.BaseRequest) -> Any:
        up = self.upstream
        return headers.request_headers(
            request.headers,
            target=up.target,
            forward_authorization=up.settings.forward_authorization,
            credential=up.credential,
            peer=request.remote,
            forwarded=up.settings.forwarded_headers,
            scheme="https" if request.secure else "http",
        )

    def _url(self, c: Classification, query: str) -> URL:
        """The upstream URL for a request (remembered for recent path/query pairs)."""
        key = (c.path, query)
        url = self._urls.get(key)
        if url is None:
            target = self.upstream.target
            url = URL.build(
                scheme=target.scheme,
                authority=target.raw_authority,
                path=c.path,
                query_string=query,
                encoded=True,
            )
            if len(self._urls) >= URL_CACHE_SIZE:
                del self._urls[next(iter(self._urls))]
            self._urls[key] = url
        return url

    @staticmethod
    def _cut(request: web.BaseRequest) -> None:
        """Reset the borrower's connection so a cut stream never looks like a clean end."""
        reset_connection(request.transport)
