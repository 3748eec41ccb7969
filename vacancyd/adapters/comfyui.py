"""ComfyUI (comfyanonymous/ComfyUI ``server.py``, ``execution.py``, ``comfy_execution/jobs.py``).

Routes. ComfyUI registers every route twice, as ``/x`` and ``/api/x`` (server.py: "Prefix
every route with /api for easier matching for delegation"), and its own frontend uses the
``/api`` forms, so the table lists both. ``POST /prompt`` is the only work route; it carries
no model name (a workflow graph names its checkpoints in node inputs), so admission charges
the upstream's default footprint. A borrower keeps its own results — ``GET /history/{id}`` and
``GET /api/jobs/{id}`` for the prompt IDs vacancyd assigned (others are answered 404, so a
borrower cannot read the owner's prompts), ``GET /view``, the ``GET /ws`` progress channel —
and the node and model catalogue. The queue, interrupt, free, everyone's history and job
list, uploads and ``/system_stats`` (which shows the owner's memory use) are management.

Reclaim (docs/reclaim.md). ComfyUI answers ``/prompt`` as soon as the prompt is queued
(``post_prompt`` -> ``prompt_queue.put``), so closing the connection cancels nothing. Instead
vacancyd sets each borrowed prompt's ``prompt_id`` itself (a canonical lowercase UUID4, the
only form newer servers accept: ``jobs.py validate_job_id``; a borrower's own value is always
replaced so a borrower can never make vacancyd name someone else's prompt), keeps the job in
the ledger's ``tracking`` phase until ``GET /queue`` no longer lists it, and on a reclaim:

* deletes borrowed IDs still pending: ``POST /queue {"delete": [ids]}``;
* stops a borrowed prompt only when ``GET /queue`` shows it running, with the narrowest
  request the server has: ``POST /api/jobs/{id}/cancel`` (checks and interrupts under the
  queue lock; newer releases) and, where that answers 404 or 405 (0.3.x), ``POST /interrupt
  {"prompt_id": id}``, which interrupts only if that prompt is the running one.

Only borrowed IDs are ever named. With ``yield_on_veto`` the unload is ``POST /free
{"unload_models": true, "free_memory": true}`` — skipped (and logged) when the queue shows a
running or pending prompt vacancyd did not admit, since freeing would slow the owner's own
job. ComfyUI applies ``/free`` after the running prompt finishes.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections import OrderedDict
from typing import Any
from urllib.parse import unquote

import aiohttp
from yarl import URL

from vacancyd.adapters.base import Adapter, UpstreamError
from vacancyd.adapters.bodyparse import SMALL_JSON_BYTES
from vacancyd.core.classify import Route, RouteClass, RouteTable, route
from vacancyd.core.observations import ProbeError
from vacancyd.core.snapshot import ServerState

WORK, PASS, RES, MGMT = (
    RouteClass.WORK,
    RouteClass.PASSTHROUGH,
    RouteClass.RESULTS,
    RouteClass.MANAGEMENT,
)


def _twins(methods: str, path: str, klass: RouteClass, **kw: object) -> tuple[Route, Route]:
    return route(methods, path, klass, **kw), route(methods, "/api" + path, klass, **kw)


TABLE = RouteTable(
    "comfyui",
    (
        *_twins("POST", "/prompt", WORK, model_key=None),
        *_twins("GET", "/history/{}", RES),
        *_twins("GET", "/view", RES),
        *_twins("GET", "/ws", RES, websocket=True),
        route("GET", "/api/jobs/{}", RES),
        *_twins("GET", "/object_info", PASS),
        *_twins("GET", "/object_info/{}", PASS),
        *_twins("GET", "/models", PASS),
        *_twins("GET", "/models/{}", PASS),
        *_twins("GET", "/embeddings", PASS),
        *_twins("GET", "/extensions", PASS),
        *_twins("GET", "/features", PASS),
        *_twins("GET", "/prompt", MGMT),
        *_twins("GET POST", "/queue", MGMT),
        *_twins("POST", "/interrupt", MGMT),
        *_twins("POST", "/free", MGMT),
        *_twins("GET POST", "/history", MGMT),
        *_twins("GET", "/system_stats", MGMT),
        *_twins("POST", "/upload/image", MGMT),
        *_twins("POST", "/upload/mask", MGMT),
        route("GET", "/api/jobs", MGMT),
        route("POST", "/api/jobs/cancel", MGMT),
        route("POST", "/api/jobs/{}/cancel", MGMT),
    ),
)

#: A queue read stops at this many bytes (docs/reclaim.md: the read for foreign prompts).
MAX_QUEUE_BYTES = 16 * 1024 * 1024
#: How often a tracked prompt's queue membership is polled (seconds).
TRACK_INTERVAL_S = 0.25
#: Consecutive failed polls after which a tracked prompt's fate counts as unknown.
TRACK_MAX_FAILURES = 40
#: How many borrowed prompt IDs are remembered for the foreign-prompt check.
REMEMBER_IDS = 10_000
_EMPTY_OBJECT = re.compile(rb"\s*\{\s*\}")


def new_prompt_id() -> str:
    """A canonical lowercase hyphenated UUID4, the form ``validate_job_id`` accepts."""
    return str(uuid.uuid4())


def queue_ids(payload: Any) -> tuple[list[str], list[str]]:
    """(running, pending) prompt IDs from ``GET /queue``.

    Items are ``[number, prompt_id, prompt, extra_data, outputs_to_execute]`` (server.py
    ``get_queue``); ``queue_pending`` is the raw heap, unsorted. Raises UpstreamError.
    """
    if not isinstance(payload, dict):
        raise UpstreamError("/queue did not return a JSON object")
    out: list[list[str]] = []
    for key in ("queue_running", "queue_pending"):
        items = payload.get(key)
        if not isinstance(items, list):
            raise UpstreamError(f"/queue lacks a {key} list")
        ids = []
        for item in items:
            if not isinstance(item, list) or len(item) < 2 or not isinstance(item[1], str):
                raise UpstreamError(f"/queue {key} item is not [number, prompt_id, ...]")
            ids.append(item[1])
        out.append(ids)
    return out[0], out[1]


class ComfyController:
    """Prompt IDs, tracking, cancellation and ``/free`` for one ComfyUI server."""

    can_cancel = True

    def __init__(self, session: aiohttp.ClientSession, target: URL) -> None:
        self.session = session
        self.target = target
        #: Every prompt ID vacancyd assigned on this server, oldest first (bounded).
        self.borrowed: OrderedDict[str, None] = OrderedDict()
        #: None until probed; False once the jobs cancel route answered 404/405.
        self.jobs_cancel: bool | None = None

    # -- submission ----------------------------------------------------------------------

    def prepare(self, route: Route, body: bytes) -> tuple[bytes, str | None]:
        """Give a ``/prompt`` body a ``prompt_id`` vacancyd chose, at the cost of a copy.

        The key is appended after the body's own keys rather than the document re-encoded:
        ComfyUI reads the body with ``json.loads``, where the last of two equal keys wins, so
        a borrower's own ``prompt_id`` is overridden. A body that is not a JSON object is
        forwarded unchanged (ComfyUI answers its own error; nothing is queued). The proxy has
        already checked a large body is one valid JSON object, so only a small one is parsed.
        """
        if not route.pattern.endswith("/prompt"):
            return body, None
        end = len(body)
        while end and body[end - 1] in b" \t\r\n":  # rstrip without copying a large body
            end -= 1
        text = body if end == len(body) else body[:end]
        if len(body) <= SMALL_JSON_BYTES:
            try:
                payload = json.loads(body)
            except (ValueError, UnicodeDecodeError, RecursionError):
                return body, None
            if not isinstance(payload, dict):
                return body, None
            empty = not payload
        else:
            start = 0
            while start < end and body[start] in b" \t\r\n":
                start += 1
            if not text.endswith(b"}") or body[start : start + 1] != b"{":
                return body, None
            empty = _EMPTY_OBJECT.fullmatch(text) is not None
        prompt_id = new_prompt_id()
        self.borrowed[prompt_id] = None
        while len(self.borrowed) > REMEMBER_IDS:
            self.borrowed.popitem(last=False)
        field = b'"prompt_id": ' + json.dumps(prompt_id).encode()
        return text[:-1] + (field if empty else b", " + field) + b"}", prompt_id

    def allows_result(self, route: Route, path: str) -> bool:
        """``/history/{id}`` and ``/api/jobs/{id}`` only for prompt IDs vacancyd assigned.

        ``/view`` and ``/ws`` carry no prompt ID and stay open (see the module docstring).
        """
        if route.pattern.endswith(("/history/{}", "/api/jobs/{}")):
            return unquote(path.rsplit("/", 1)[-1]) in self.borrowed
        return True

    # -- calls ---------------------------------------------------------------------------

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        try:
            async with self.session.request(
                method, self.target.with_path(path), json=body, allow_redirects=False
            ) as resp:
                data = await resp.content.read(MAX_QUEUE_BYTES + 1)
                return resp.status, data
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(f"{method} {path} failed: {exc.__class__.__name__}: {exc}") from exc

    async def queue(self) -> tuple[list[str], list[str]]:
        status, data = await self._call("GET", "/queue")
        if status != 200:
            raise UpstreamError(f"GET /queue answered {status}")
        if len(data) > MAX_QUEUE_BYTES:
            raise UpstreamError(f"GET /queue is larger than {MAX_QUEUE_BYTES} bytes")
        try:
            payload = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise UpstreamError(f"GET /queue is not JSON: {exc}") from exc
        return queue_ids(payload)

    async def wait_done(self, key: str) -> None:
        failures = 0
        while True:
            try:
                running, pending = await self.queue()
            except UpstreamError:
                failures += 1
                if failures >= TRACK_MAX_FAILURES:
                    raise
            else:
                failures = 0
                if key not in running and key not in pending:
                    return
            await asyncio.sleep(TRACK_INTERVAL_S)

    async def cancel(self, keys: list[str]) -> str:
        wanted = [k for k in keys if k in self.borrowed]  # only ever name borrowed IDs
        running, pending = await self.queue()
        deleted = [k for k in wanted if k in pending]
        if deleted:
            status, _ = await self._call("POST", "/queue", {"delete": deleted})
            if status != 200:
                raise UpstreamError(f"POST /queue delete answered {status}")
        stopped = []
        for key in (k for k in wanted if k in running):
            stopped.append(f"{key} via {await self._interrupt(key)}")
        parts = []
        if deleted:
            parts.append(f"deleted pending {', '.join(deleted)}")
        if stopped:
            parts.append(f"interrupted {', '.join(stopped)}")
        return "; ".join(parts) or "no borrowed prompt was queued or running"

    async def _interrupt(self, key: str) -> str:
        if self.jobs_cancel is not False:
            status, _ = await self._call("POST", f"/api/jobs/{key}/cancel")
            if status in (404, 405):
                self.jobs_cancel = False
            elif status == 200:
                self.jobs_cancel = True
                return "/api/jobs/{id}/cancel"
            else:
                raise UpstreamError(f"POST /api/jobs/{key}/cancel answered {status}")
        status, _ = await self._call("POST", "/interrupt", {"prompt_id": key})
        if status != 200:
            raise UpstreamError(f"POST /interrupt answered {status}")
        return "/interrupt"

    async def unload(self, admitted: frozenset[str]) -> tuple[str, str]:
        try:
            running, pending = await self.queue()
        except UpstreamError as exc:
            foreign = None
            read_error: str | None = str(exc)
        else:
            read_error = None
            foreign = next(
                (p for p in (*running, *pending) if p not in self.borrowed and p not in admitted),
                None,
            )
        if foreign is not None:
            return "skipped", f"the queue holds prompt {foreign}, which vacancyd did not admit"
        status, data = await self._call(
            "POST", "/free", {"unload_models": True, "free_memory": True}
        )
        if status != 200:
            raise UpstreamError(f"POST /free answered {status}: {data[:200]!r}")
        detail = "asked ComfyUI to unload its models and free memory"
        if read_error is not None:
            detail += f" (queue unreadable: {read_error})"
        return "unloaded", detail

    async def warm(self, model: str) -> str:
        raise UpstreamError("ComfyUI has no model load API; warm_model applies to ollama")

    async def resident(self) -> list[str] | None:
        return None  # ComfyUI lists no loaded models; /free is its whole unload


# -- residency observation -----------------------------------------------------------------


def parse_system_stats(payload: Any) -> tuple[float | None, int]:
    """(MiB torch's allocator holds on the GPU, number of GPU devices) from ``/system_stats``.

    ``torch_vram_total`` is what PyTorch's caching allocator has reserved (bytes): ComfyUI
    reuses it for its next prompt, so the gate adds it back to free memory on a route with
    exactly one GPU. CPU devices are not counted. The allocator figure is None unless
    exactly one GPU is listed. Raises :class:`ProbeError` for any other shape.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("devices"), list):
        raise ProbeError("/system_stats did not return {'devices': [...]}")
    gpus = []
    for device in payload["devices"]:
        if not isinstance(device, dict):
            raise ProbeError("/system_stats lists a device that is not an object")
        if device.get("type") == "cpu":
            continue
        gpus.append(device)
    if len(gpus) != 1:
        return None, len(gpus)
    reserved = gpus[0].get("torch_vram_total")
    if isinstance(reserved, bool) or not isinstance(reserved, int | float) or reserved < 0:
        raise ProbeError(f"/system_stats torch_vram_total is not a byte count: {reserved!r}")
    return reserved / (1024 * 1024), 1


async def observe(session: aiohttp.ClientSession, target: URL) -> ServerState:
    """``GET /system_stats`` and ``GET /queue``: the allocator's memory, and whether any
    prompt is running or pending. Raises :class:`ProbeError` on any failure."""
    payloads = []
    for path in ("/system_stats", "/queue"):
        try:
            async with session.get(target.with_path(path), allow_redirects=False) as resp:
                if resp.status != 200:
                    raise ProbeError(f"GET {path} answered {resp.status}")
                data = await resp.content.read(MAX_QUEUE_BYTES + 1)
        except aiohttp.ClientError as exc:
            raise ProbeError(f"GET {path} failed: {exc.__class__.__name__}: {exc}") from exc
        if len(data) > MAX_QUEUE_BYTES:
            raise ProbeError(f"GET {path} is larger than {MAX_QUEUE_BYTES} bytes")
        try:
            payloads.append(json.loads(data))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProbeError(f"GET {path} returned invalid JSON: {exc}") from exc
    allocator, devices = parse_system_stats(payloads[0])
    try:
        running, pending = queue_ids(payloads[1])
    except UpstreamError as exc:
        raise ProbeError(str(exc)) from exc
    return ServerState(
        resident_models=None,
        idle=not running and not pending,
        allocator_mib=allocator if allocator is not None else 0.0,
        devices=devices,
    )


ADAPTER = Adapter(name="comfyui", table=TABLE, make_controller=ComfyController, observe=observe)
