"""The API listener (spec "API and metrics"; product map O1, O2).

Public: ``GET /healthz`` (liveness), ``GET /readyz`` (200/503, no detail). Read scope:
``GET /status``, ``GET /metrics``, ``GET /events`` (server-sent state transitions, see
:mod:`vacancyd.api.events`). Admin scope: ``PUT /admin/lending`` and
``PUT /admin/resources/{name}`` with body ``{"enabled": true|false}``; ``POST /admin/reclaim``
with an optional body ``{"resource": NAME}`` raises an operator reclaim edge (docs/reclaim.md);
``POST /admin/jobs/{id}/release`` frees a held ledger job (product map L5).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vacancyd.api import events
from vacancyd.api.auth import Authenticator
from vacancyd.api.metrics import Metrics
from vacancyd.api.status import render_status
from vacancyd.core.ledger import Job
from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.core.refusal import error_body
from vacancyd.state import SharedState

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer aiohttp's own errors (404, 405, 413) as JSON like every other API error."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {
            404: ErrorCode.NOT_FOUND,
            405: ErrorCode.METHOD_NOT_ALLOWED,
            413: ErrorCode.REQUEST_TOO_LARGE,
        }.get(exc.status, ErrorCode.HTTP_ERROR)
        return web.json_response(
            error_body(
                f"{request.method} {request.path}: {exc.reason}", ErrorType.INVALID_REQUEST, code
            ),
            status=exc.status,
            headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"},
        )


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


def make_api(
    state: SharedState,
    auth: Authenticator,
    metrics: Metrics,
    *,
    started_at: float,
    release: Callable[[int], Job | None],
    events_keepalive_s: float = events.KEEPALIVE_S,
) -> web.Application:
    """The operator's application. ``release(job_id)`` frees a borrowed job's reservation
    and returns its ledger record as it was (None for an unknown job)."""
    app = web.Application(client_max_size=64 * 1024, middlewares=[json_errors])
    events.install(app)

    def scoped(scope: str, handler: Handler) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            denied = auth.check(request, scope)
            return denied if denied is not None else await handler(request)

        return wrapped

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ready, _why = state.ready(state.clock())
        return web.json_response(
            {"status": "ready" if ready else "not ready"}, status=200 if ready else 503
        )

    async def status(_: web.Request) -> web.Response:
        return web.json_response(render_status(state, started_at))

    async def metrics_view(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def put_lending(request: web.Request) -> web.Response:
        enabled = await _read_enabled(request)
        if isinstance(enabled, web.Response):
            return enabled
        changed = state.set_lending(enabled)
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
        log.info("admin set resource %s enabled=%s (from %s)", name, enabled, request.remote)
        return web.json_response({"resource": name, "enabled": enabled, "changed": changed})

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
        state.raise_edge("admin", state.clock(), resource=resource, detail="admin request")
        return web.json_response({"raised": True, "reclaim": dict(state.reclaim_views)})

    async def release_job(request: web.Request) -> web.Response:
        try:
            job_id = int(request.match_info["id"])
        except ValueError:
            return _bad_request("job id must be an integer")
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

    app.router.add_post("/admin/reclaim", scoped("admin", post_reclaim))
    app.router.add_post("/admin/jobs/{id}/release", scoped("admin", release_job))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", scoped("read", status))
    app.router.add_get("/metrics", scoped("read", metrics_view))
    app.router.add_get(
        "/events", scoped("read", events.make_handler(state, keepalive_s=events_keepalive_s))
    )
    app.router.add_put("/admin/lending", scoped("admin", put_lending))
    app.router.add_put("/admin/resources/{name}", scoped("admin", put_resource))
    return app
