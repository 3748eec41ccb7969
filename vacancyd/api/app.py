"""The API listener (docs/architecture.md).

Public: ``GET /healthz`` (liveness), ``GET /readyz`` (200/503, no detail). Read scope:
``GET /status``, ``GET /metrics``, ``GET /events`` (server-sent state transitions, see
:mod:`vacancyd.api.events`). Admin scope: ``PUT /admin/lending`` and
``PUT /admin/resources/{name}`` with body ``{"enabled": true|false}``; ``POST /admin/reclaim``
with an optional body ``{"resource": NAME}`` raises an operator reclaim edge (docs/reclaim.md);
``POST /admin/jobs/{id}/release`` frees a held ledger job.
``POST /admin/pause`` with ``{}`` (until resumed), ``{"for": "30m"}``, ``{"until": "18:00"}``
or ``{"until_idle": true}`` (each optionally with ``"reason"``) pauses lending (a null
field, or ``"until_idle": false``, is refused: a pause until resumed is asked for with ``{}``);
``POST /admin/resume`` ends the pause (docs/presence.md "Pausing").
``GET /events/recent`` (read scope): the last hour of transitions (:class:`events.EventLog`).
``GET /usage?since=24h&by=borrower`` (read scope): the usage ledger grouped
(:mod:`vacancyd.api.usage`).
Login links (``vacancyd open``, :mod:`vacancyd.web.logins`): ``POST /login/ticket`` (read
scope, body ``{}`` or ``{"for_uid": UID}`` from root) -> ``{"ticket", "path",
"expires_in_s"}``; ``POST /login`` with ``{"ticket": T}`` (no token) -> ``{"token",
"scopes": ["read"], "expires_in_s"}`` or 401 ``invalid_login_ticket``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from aiohttp import HttpVersion11, hdrs, web

from vacancyd.api import events, page
from vacancyd.api.auth import Authenticator
from vacancyd.api.metrics import Metrics
from vacancyd.api.status import StatusViews, render_status
from vacancyd.api.usage import UsageReport, usage_handler
from vacancyd.core.ledger import Job
from vacancyd.core.numbers import parse_int
from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.core.refusal import error_body
from vacancyd.proxy import probe
from vacancyd.state import SharedState
from vacancyd.web.errors import json_errors
from vacancyd.web.logins import (
    SESSION_SCOPES,
    SESSION_TTL_S,
    TICKET_TTL_S,
    TicketRefused,
    connection_uid,
)
from vacancyd.web.metrics import exposition

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]
#: The ``Expect: 100-continue`` handler of the admin mutations (``expect_handler=`` of a route
#: added by ``extra_routes``): refuses a request without the admin scope before its body.
EXPECT_ADMIN: web.AppKey[ExpectHandler] = web.AppKey("expect_admin")


class PauseControl(Protocol):
    """What the pause routes need (``vacancyd.control.owner.OwnerControls``)."""

    def make_pause(
        self,
        *,
        until: str | None = None,
        for_: str | None = None,
        until_idle: bool = False,
        reason: str = "",
    ) -> Any: ...

    async def set_pause(self, pause: Any) -> None: ...

    async def resume(self) -> bool: ...

    def view(self) -> dict[str, Any]: ...


def _bad_request(message: str) -> web.Response:
    return web.json_response(
        error_body(message, ErrorType.INVALID_REQUEST, ErrorCode.INVALID_BODY), status=400
    )


async def _read_json(request: web.Request, empty: bytes) -> object | web.Response:
    """The request's JSON body (``empty`` when there is none), or a 400 saying what is wrong."""
    try:
        payload: object = json.loads(await request.read() or empty)
    except RecursionError:
        return _bad_request("body nests JSON too deeply")
    except (ValueError, UnicodeDecodeError) as exc:
        return _bad_request(f"body is not valid JSON: {exc}")
    return payload


async def _read_enabled(request: web.Request) -> bool | web.Response:
    payload = await _read_json(request, b"null")
    if isinstance(payload, web.Response):
        return payload
    if not isinstance(payload, dict) or set(payload) != {"enabled"}:
        return _bad_request('body must be exactly {"enabled": true|false}')
    enabled = payload["enabled"]
    if not isinstance(enabled, bool):
        return _bad_request('"enabled" must be true or false')
    return enabled


def _not_found(message: str) -> web.Response:
    return web.json_response(
        error_body(message, ErrorType.NOT_FOUND, ErrorCode.NOT_FOUND), status=404
    )


async def _connection_uid(request: web.Request) -> int | None:
    """The local user owning the client's end of this connection (vacancyd.web.logins)."""
    transport = request.transport
    if transport is None:
        return None
    peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not isinstance(peer, tuple) or not isinstance(local, tuple):
        return None
    return await asyncio.to_thread(connection_uid, peer[:2], local[:2])


def health_probe(state: SharedState, path: str) -> tuple[int, dict[str, object]] | None:
    """(status, body) for ``/healthz`` and ``/readyz``, else None. Also answers these
    probes on connections refused while the API listener is full."""
    if path == "/healthz":
        return 200, {"status": "ok"}
    if path == "/readyz":
        ready, _why = state.ready(state.clock())
        return (200, {"status": "ready"}) if ready else (503, {"status": "not ready"})
    return None


def make_api(
    state: SharedState,
    auth: Authenticator,
    metrics: Metrics,
    *,
    started_at: float,
    release: Callable[[int], Job | None],
    reclaim: Callable[[str | None, str], list[str]],
    switched: Callable[[], object] | None = None,
    events_keepalive_s: float = events.KEEPALIVE_S,
    max_event_subscribers: int = 32,
    controls: PauseControl | None = None,
    probes: Mapping[str, probe.ProbeEndpoint] | None = None,
    views: StatusViews | None = None,
    usage: UsageReport | None = None,
    extra_routes: Callable[
        [web.Application, Callable[[str, Handler], Handler], Callable[[Handler], Handler]], None
    ]
    | None = None,
) -> web.Application:
    """The operator's application. ``release(job_id)`` frees a borrowed job's reservation
    and returns its ledger record as it was (None for an unknown job); ``reclaim(resource,
    detail)`` raises an operator's reclaim edge (of every upstream when ``resource`` is None)
    and returns the upstreams it reclaims; ``switched()`` is called after an operator turned
    lending or a resource on or off (the reclaimer warms what may now be lent). ``probes`` maps an
    upstream name to its lendability probe (which checks its own token rule); it may be
    filled after this call. ``views``: what their owners render for ``/status``.
    ``usage``: what ``GET /usage`` reads (:mod:`vacancyd.api.usage`; None: it answers 404).
    ``extra_routes(app, scoped, mutation)`` adds further routes (the debug window and
    diagnostics, vacancyd.api.ops)."""
    app = web.Application(client_max_size=64 * 1024, middlewares=[json_errors])
    events.install(app)
    guards = _Guards(auth)
    app[EXPECT_ADMIN] = guards.expect_admin
    _add_login_routes(app, guards)
    _add_owner_routes(app, guards, controls)
    _add_probe_routes(app, state, auth, probes)
    _add_admin_routes(app, guards, state, release=release, reclaim=reclaim, switched=switched)
    _add_read_routes(app, guards, state, metrics, started_at, views, usage)
    _add_event_routes(
        app,
        guards,
        state,
        keepalive_s=events_keepalive_s,
        max_subscribers=max_event_subscribers,
    )
    if extra_routes is not None:
        extra_routes(app, guards.scoped, guards.mutation)
    return app


class _Guards:
    """The scope and browser guards the routes are wrapped in, over one :class:`Authenticator`."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    def scoped(self, scope: str, handler: Handler) -> Handler:
        """``handler`` behind the token check of ``scope`` ("read", "admin", ...)."""
        auth = self.auth

        async def wrapped(request: web.Request) -> web.StreamResponse:
            denied = auth.check(request, scope)
            return denied if denied is not None else await handler(request)

        return wrapped

    def guarded(self, handler: Handler) -> Handler:
        """The browser guards of a mutation (Origin, Sec-Fetch-Site, Content-Type) alone."""
        auth = self.auth

        async def wrapped(request: web.Request) -> web.StreamResponse:
            denied = auth.check_mutation(request)
            return denied if denied is not None else await handler(request)

        return wrapped

    def mutation(self, handler: Handler) -> Handler:
        """Admin scope plus the browser guards (Origin, Sec-Fetch-Site, Content-Type)."""
        auth = self.auth

        async def wrapped(request: web.Request) -> web.StreamResponse:
            denied = auth.check(request, "admin") or auth.check_mutation(request)
            return denied if denied is not None else await handler(request)

        return wrapped

    async def expect_admin(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue`` on an admin mutation: a request that would be refused
        whatever its body (no admin scope, a browser guard) is refused before the client
        sends the body, never after a ``100 Continue``."""
        auth = self.auth
        if request.version != HttpVersion11:
            return None
        expect = request.headers.get(hdrs.EXPECT, "")
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
        if auth.check(request, "admin", record=False) is not None:
            return auth.check(request, "admin")
        denied = auth.check_mutation(request)
        if denied is not None:
            return denied
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def add_mutation(self, app: web.Application, method: str, path: str, handler: Handler) -> None:
        """Route ``method path`` to ``handler`` as an admin mutation, with its Expect check."""
        app.router.add_route(method, path, self.mutation(handler), expect_handler=self.expect_admin)


def _add_read_routes(
    app: web.Application,
    guards: _Guards,
    state: SharedState,
    metrics: Metrics,
    started_at: float,
    views: StatusViews | None,
    usage: UsageReport | None,
) -> None:
    """The status page, the probes of liveness and readiness, ``/status``, ``/metrics`` and
    ``/usage``."""

    async def healthz(request: web.Request) -> web.Response:
        answer = health_probe(state, request.path)
        assert answer is not None
        status, body = answer
        return web.json_response(body, status=status)

    readyz = healthz

    async def status(_: web.Request) -> web.Response:
        return web.json_response(render_status(state, started_at, views))

    async def metrics_view(request: web.Request) -> web.Response:
        body, content_type = exposition(metrics.registry, request.headers.get("Accept"))
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    app.router.add_get("/", page.status_page)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", guards.scoped("read", status))
    app.router.add_get("/metrics", guards.scoped("read", metrics_view))
    app.router.add_get("/usage", guards.scoped("read", usage_handler(usage)))


def _add_event_routes(
    app: web.Application,
    guards: _Guards,
    state: SharedState,
    *,
    keepalive_s: float,
    max_subscribers: int,
) -> None:
    """``/events/recent`` (the last hour, kept by an :class:`events.EventLog` that stops at
    the app's cleanup) and the server-sent ``/events``."""
    history = events.EventLog(state)

    async def stop_history(_: web.Application) -> None:
        history.unsubscribe()

    app.on_cleanup.append(stop_history)
    app.router.add_get("/events/recent", guards.scoped("read", events.recent_handler(history)))
    app.router.add_get(
        "/events",
        guards.scoped(
            "read",
            events.make_handler(state, keepalive_s=keepalive_s, max_subscribers=max_subscribers),
        ),
    )


def _add_admin_routes(
    app: web.Application,
    guards: _Guards,
    state: SharedState,
    *,
    release: Callable[[int], Job | None],
    reclaim: Callable[[str | None, str], list[str]],
    switched: Callable[[], object] | None,
) -> None:
    """The admin mutations on the shared store: raise a reclaim edge, release a job, and
    the lending and resource switches (``switched()`` after a switch that changed)."""

    async def post_reclaim(request: web.Request) -> web.Response:
        payload = await _read_json(request, b"{}")
        if isinstance(payload, web.Response):
            return payload
        if not isinstance(payload, dict) or not set(payload) <= {"resource"}:
            return _bad_request('body must be {} or {"resource": NAME}')
        resource = payload.get("resource")
        if resource is not None and resource not in state.resources:
            return _bad_request(f"no resource named {resource!r}")
        log.warning(
            "admin raised a reclaim edge%s (from %s)",
            f" on {resource}" if resource else "",
            request.remote,
        )
        reclaim(resource, "admin request")
        return web.json_response({"raised": True, "reclaim": dict(state.reclaim_views)})

    async def release_job(request: web.Request) -> web.Response:
        try:
            job_id = parse_int(request.match_info["id"], "job id")
        except ValueError as exc:
            return _bad_request(str(exc))
        job = state.ledger.get(job_id)
        if job is None:
            return web.json_response(
                error_body(f"no job {job_id}", ErrorType.NOT_FOUND, ErrorCode.UNKNOWN_JOB),
                status=404,
            )
        log.warning(
            "admin released job %d (%s, %s) (from %s)",
            job_id,
            job.upstream,
            job.phase,
            request.remote,
        )
        release(job_id)
        return web.json_response({"released": job_id, "phase": job.phase.value})

    async def put_lending(request: web.Request) -> web.Response:
        enabled = await _read_enabled(request)
        if isinstance(enabled, web.Response):
            return enabled
        changed = state.set_lending(enabled)
        if changed and switched is not None:
            switched()
        log.info("admin set lending %s (from %s)", enabled, request.remote)
        return web.json_response({"lending_enabled": enabled, "changed": changed})

    async def put_resource(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        enabled = await _read_enabled(request)
        if isinstance(enabled, web.Response):
            return enabled
        try:
            changed = state.set_resource_switch(name, enabled)
        except KeyError:
            return web.json_response(
                error_body(
                    f"no resource named {name!r} (declared: {', '.join(sorted(state.switches))})",
                    ErrorType.NOT_FOUND,
                    ErrorCode.UNKNOWN_RESOURCE,
                ),
                status=404,
            )
        if changed and switched is not None:
            switched()
        log.info("admin set resource %s enabled=%s (from %s)", name, enabled, request.remote)
        return web.json_response({"resource": name, "enabled": enabled, "changed": changed})

    guards.add_mutation(app, "POST", "/admin/reclaim", post_reclaim)
    guards.add_mutation(app, "POST", "/admin/jobs/{id}/release", release_job)
    guards.add_mutation(app, "PUT", "/admin/lending", put_lending)
    guards.add_mutation(app, "PUT", "/admin/resources/{name}", put_resource)


def _no_controls() -> web.Response:
    return web.json_response(
        error_body(
            "this daemon has no owner controls",
            ErrorType.NOT_FOUND,
            ErrorCode.NO_CONTROLS,
        ),
        status=404,
    )


def _add_owner_routes(app: web.Application, guards: _Guards, controls: PauseControl | None) -> None:
    """``POST /admin/pause`` and ``POST /admin/resume`` (404 ``no_controls`` without
    ``controls``)."""
    guards.add_mutation(app, "POST", "/admin/pause", _pause_handler(controls))
    guards.add_mutation(app, "POST", "/admin/resume", _resume_handler(controls))


def _pause_handler(controls: PauseControl | None) -> Handler:
    """``POST /admin/pause``: its body checked field by field, then ``controls.set_pause``."""

    async def post_pause(request: web.Request) -> web.Response:
        if controls is None:
            return _no_controls()
        payload = await _read_json(request, b"{}")
        if isinstance(payload, web.Response):
            return payload
        allowed = {"until", "for", "until_idle", "reason"}
        if not isinstance(payload, dict) or not set(payload) <= allowed:
            return _bad_request(
                'body must be {}, {"for": DURATION}, {"until": TIME} or {"until_idle": true}, '
                'optionally with "reason"'
            )
        # A pause until resumed is asked for by saying nothing else ({}), never by a field
        # that is there but says no: a null or a false until_idle would otherwise silently
        # become an indefinite pause.
        for key in ("until", "for", "until_idle", "reason"):
            if key in payload and payload[key] is None:
                return _bad_request(
                    f'"{key}" is null: leave it out (send {{}} to pause until resumed)'
                )
        if payload.get("until_idle") is False:
            return _bad_request(
                '"until_idle" may only be true: send {} to pause until resumed, or "for" or '
                '"until" for a pause that ends by itself'
            )
        until, for_, idle, reason = (
            payload.get("until"),
            payload.get("for"),
            payload.get("until_idle", False),
            payload.get("reason", ""),
        )
        if until is not None and not isinstance(until, str):
            return _bad_request('"until" must be a string (HH:MM or an ISO 8601 time)')
        if for_ is not None and not isinstance(for_, str):
            return _bad_request('"for" must be a string such as "30m" or "1h30m"')
        if not isinstance(idle, bool):
            return _bad_request('"until_idle" must be true or false')
        if not isinstance(reason, str) or len(reason) > 200:
            return _bad_request('"reason" must be a string of at most 200 characters')
        try:
            pause = controls.make_pause(until=until, for_=for_, until_idle=idle, reason=reason)
        except ValueError as exc:
            return _bad_request(f"cannot pause: {exc}")
        await controls.set_pause(pause)
        log.warning("admin paused lending (from %s)", request.remote)
        view = controls.view()
        return web.json_response(
            {
                "paused": True,
                "pause": view["pause"],
                "persisted": view["pause_persist_error"] is None,
                "persist_error": view["pause_persist_error"],
            }
        )

    return post_pause


def _resume_handler(controls: PauseControl | None) -> Handler:
    """``POST /admin/resume`` with an empty body or ``{}``."""

    async def post_resume(request: web.Request) -> web.Response:
        if controls is None:
            return _no_controls()
        payload = await _read_json(request, b"{}")
        if isinstance(payload, web.Response):
            return payload
        if payload != {}:
            return _bad_request("body must be empty or {}")
        resumed = await controls.resume()
        log.info("admin resumed lending (was paused: %s; from %s)", resumed, request.remote)
        view = controls.view()
        return web.json_response({"resumed": resumed, "persist_error": view["pause_persist_error"]})

    return post_resume


def _add_probe_routes(
    app: web.Application,
    state: SharedState,
    auth: Authenticator,
    probes: Mapping[str, probe.ProbeEndpoint] | None,
) -> None:
    """``/lendable/{upstream}``, any method: each upstream's probe checks its own token rule;
    an unknown name is answered without the names to a caller that may not see them."""

    async def lendable(request: web.Request) -> web.Response:
        name = request.match_info["upstream"]
        endpoint = (probes or {}).get(name)
        if endpoint is not None:
            return endpoint.answer(request)
        if any(p.public for p in (probes or {}).values()):
            return probe.unknown_upstream(name, None)  # no names to an anonymous caller
        denied = auth.check(request, probe.SCOPE)
        return denied or probe.unknown_upstream(name, sorted(state.upstreams))

    app.router.add_route("*", "/lendable/{upstream}", lendable)


def _add_login_routes(app: web.Application, guards: _Guards) -> None:
    """``POST /login/ticket`` (read scope and the browser guards) and ``POST /login`` (no
    token: the ticket is the credential), both 404 without login links."""
    app.router.add_post(
        "/login/ticket", guards.scoped("read", guards.guarded(_login_ticket_handler(guards.auth)))
    )
    app.router.add_post("/login", _login_handler(guards.auth))


def _login_ticket_handler(auth: Authenticator) -> Handler:
    """``POST /login/ticket``: mint a single-use login link (vacancyd.web.logins)."""

    async def login_ticket(request: web.Request) -> web.Response:
        """A single-use login link for the status page (vacancyd.web.logins)."""
        if auth.logins is None:
            return _not_found("this daemon has no login links")
        payload = await _read_json(request, b"{}")
        if isinstance(payload, web.Response):
            return payload
        if not isinstance(payload, dict) or not set(payload) <= {"for_uid"}:
            return _bad_request('body must be {} or {"for_uid": UID}')
        uid = await _connection_uid(request)
        for_uid = payload.get("for_uid")
        if for_uid is not None:
            if not isinstance(for_uid, int) or isinstance(for_uid, bool) or for_uid < 0:
                return _bad_request('"for_uid" must be a user id (an integer of 0 or more)')
            # A ticket bound to someone else is no use to its asker; only root (sudo
            # vacancyd open) has a reason to ask for one, and only it may.
            if uid not in (0, None) and for_uid != uid:
                return web.json_response(
                    error_body(
                        "only root may ask for another user's login link",
                        ErrorType.PERMISSION,
                        ErrorCode.INSUFFICIENT_SCOPE,
                    ),
                    status=403,
                )
            uid = for_uid
        ticket = auth.logins.mint(time.monotonic(), uid)
        log.info(
            "login link issued%s (from %s)",
            "" if uid is None else f" for uid {uid}",
            request.remote,
        )
        return web.json_response(
            {"ticket": ticket, "path": f"/#login={ticket}", "expires_in_s": TICKET_TTL_S},
            headers={"Cache-Control": "no-store"},
        )

    return login_ticket


def _login_handler(auth: Authenticator) -> Handler:
    """``POST /login``: trade a login ticket for a read-only session token."""

    async def login(request: web.Request) -> web.Response:
        """Trade a login ticket for a read-only session token (the status page)."""
        if auth.logins is None:
            return _not_found("this daemon has no login links")
        ctype = (request.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            return web.json_response(
                error_body(
                    "send the ticket as Content-Type: application/json",
                    ErrorType.INVALID_REQUEST,
                    ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                ),
                status=415,
            )
        payload = await _read_json(request, b"null")
        if isinstance(payload, web.Response):
            return payload
        if not isinstance(payload, dict) or not isinstance(payload.get("ticket"), str):
            return _bad_request('body must be {"ticket": TICKET}')
        uid = await _connection_uid(request)
        try:
            session = auth.logins.redeem(payload["ticket"], time.monotonic(), uid)
        except TicketRefused as exc:
            log.warning("login link refused: %s (from %s)", exc, request.remote)
            return web.json_response(
                error_body(str(exc), ErrorType.AUTHENTICATION, ErrorCode.INVALID_LOGIN_TICKET),
                status=401,
            )
        log.info("status page session opened (from %s)", request.remote)
        return web.json_response(
            {"token": session, "scopes": sorted(SESSION_SCOPES), "expires_in_s": SESSION_TTL_S},
            headers={"Cache-Control": "no-store"},
        )

    return login
