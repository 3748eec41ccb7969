"""vLLM's OpenAI-compatible server (``vllm serve``).

The OpenAI table plus vLLM's own work routes (tokenizer, pooling, scoring, reranking).
``/health`` and ``/ping`` pass through so a borrower's health checks keep working while
lending is off. ``/metrics`` and ``/load`` reveal the server's activity, and the sleep-mode
and profiling routes (present with ``VLLM_SERVER_DEV_MODE=1``) change the server's state:
all management. Like any OpenAI-compatible server, a cut stream does not prove the work
stopped (docs/reclaim.md), so a cut job is held until an administrator releases it.

Sleep as the yield action (:class:`VllmController`, with ``yield_on_veto = true``): a server
started with ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-sleep-mode`` serves ``POST /sleep``
(query ``level``, default 1: weights offloaded to CPU RAM, KV cache dropped; answers 200
with an empty body), ``POST /wake_up`` (200, empty) and ``GET /is_sleeping`` (``{"is_sleeping":
bool}``). Both POSTs may answer before the engine has finished, so each is confirmed by polling
``/is_sleeping``. Without sleep mode the routes do not exist (404): the controller then falls
back to refusing only, says so in /status, and does not ask again.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from yarl import URL

from vacancyd.adapters import openai
from vacancyd.adapters.base import Adapter, UpstreamError
from vacancyd.core.classify import Route, RouteClass, route

WORK, PASS, MGMT = RouteClass.WORK, RouteClass.PASSTHROUGH, RouteClass.MANAGEMENT

TABLE = openai.TABLE.extend(
    "vllm",
    route("POST", "/tokenize", WORK),
    route("POST", "/detokenize", WORK),
    route("POST", "/pooling", WORK),
    route("POST", "/classify", WORK),
    route("POST", "/score", WORK),
    route("POST", "/v1/score", WORK),
    route("POST", "/rerank", WORK),
    route("POST", "/v2/rerank", WORK),
    route("POST", "/invocations", WORK),
    route("GET", "/ping", PASS, no_query=True),
    route("POST", "/ping", PASS, no_query=True, model_key=None),
    route("GET", "/version", PASS),
    route("GET", "/load", MGMT),
    route("GET", "/is_sleeping", MGMT),
    route("POST", "/sleep", MGMT),
    route("POST", "/wake_up", MGMT),
    route("POST", "/collective_rpc", MGMT),
    route("POST", "/reset_prefix_cache", MGMT),
    route("POST", "/start_profile", MGMT),
    route("POST", "/stop_profile", MGMT),
    route("GET", "/server_info", MGMT),
)

#: How often /is_sleeping is polled while confirming a sleep or a wake (seconds).
CONFIRM_INTERVAL_S = 0.1
#: How long a wake before forwarding may take before the request is answered 502 (seconds).
WAKE_DEADLINE_S = 60.0


class VllmController:
    """Sleep (level 1) on reclaim and wake before the next borrowed request.

    ``state`` is ``awake``, ``asleep`` (vacancyd put it to sleep), ``sleep_failed`` (the last
    sleep was refused, for example with a 500: that reclaim only refused; the next one tries
    again) or ``unavailable`` (no sleep mode, 404: reclaim only refuses from then on);
    ``detail`` says why.
    ``last_wake_s``: seconds the latest wake took. Event-loop only.
    """

    can_cancel = False

    def __init__(self, session: aiohttp.ClientSession, target: URL) -> None:
        self.session = session
        self.target = target
        self.state = "awake"
        self.detail = ""
        self.last_wake_s: float | None = None
        self._lock = asyncio.Lock()

    def prepare(self, route: Route, body: bytes) -> tuple[bytes, str | None]:
        return body, None

    def allows_result(self, route: Route, path: str) -> bool:
        return True  # vLLM has no results routes

    async def wait_done(self, key: str) -> None:
        return None

    async def cancel(self, keys: list[str]) -> str:
        return "nothing to cancel: vLLM aborts a request when its connection closes"

    async def resident(self) -> list[str] | None:
        return None

    async def warm(self, model: str) -> str:
        await self.ensure_awake()
        return "awake"

    async def _call(self, method: str, path: str, query: dict[str, str] | None = None) -> Any:
        """(status, parsed JSON or text) of one call; raises UpstreamError when unreachable."""
        url = self.target.with_path(path)
        if query:
            url = url.with_query(query)
        try:
            async with self.session.request(method, url, allow_redirects=False) as resp:
                text = await resp.text(errors="replace")
                try:
                    payload = json.loads(text) if text else None
                except ValueError:
                    payload = text
                return resp.status, payload
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(f"{method} {path} failed: {exc.__class__.__name__}: {exc}") from exc

    async def is_sleeping(self) -> bool:
        """``GET /is_sleeping``; raises UpstreamError for any other answer than the shape."""
        status, payload = await self._call("GET", "/is_sleeping")
        if status != 200 or not isinstance(payload, dict):
            raise UpstreamError(f"GET /is_sleeping answered {status}: {str(payload)[:200]}")
        value = payload.get("is_sleeping")
        if not isinstance(value, bool):
            raise UpstreamError(f"GET /is_sleeping: is_sleeping is not a boolean: {payload!r}")
        return value

    async def _confirm(self, asleep: bool) -> None:
        # Polling is the only signal the server offers (its POST may answer early).
        while await self.is_sleeping() != asleep:  # noqa: ASYNC110
            await asyncio.sleep(CONFIRM_INTERVAL_S)

    async def unload(self, admitted: frozenset[str]) -> tuple[str, str]:
        """Put the server to sleep (level 1) and confirm it; the caller bounds the time."""
        async with self._lock:
            if self.state == "unavailable":
                return "skipped", f"sleep is unavailable ({self.detail}); refusing only"
            if self.state == "asleep":
                return "unloaded", "already asleep"
            status, payload = await self._call("POST", "/sleep", {"level": "1"})
            if status == 404:
                self.state = "unavailable"
                self.detail = (
                    "POST /sleep answered 404: the server runs without sleep mode (start it "
                    "with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode)"
                )
                return "skipped", self.detail
            if status != 200:
                # Refused this time (an engine error): refuse only now, try again next reclaim.
                self.state = "sleep_failed"
                self.detail = f"POST /sleep answered {status}: {str(payload)[:200]}; refusing only"
                raise UpstreamError(self.detail)
            await self._confirm(True)
            self.state = "asleep"
            self.detail = "asleep at level 1 (weights in CPU RAM)"
            return "unloaded", self.detail

    async def ensure_awake(self) -> float | None:
        """Wake the server if vacancyd put it to sleep; returns the seconds it took (None
        when it was awake). Raises UpstreamError (or TimeoutError past WAKE_DEADLINE_S)."""
        if self.state != "asleep":
            return None
        async with self._lock:
            if self.state != "asleep":
                return None  # another request woke it while this one waited
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with asyncio.timeout(WAKE_DEADLINE_S):
                status, payload = await self._call("POST", "/wake_up")
                if status != 200:
                    raise UpstreamError(f"POST /wake_up answered {status}: {str(payload)[:200]}")
                await self._confirm(False)
            self.last_wake_s = loop.time() - started
            self.state = "awake"
            self.detail = f"woken in {self.last_wake_s:.2f} s"
            return self.last_wake_s

    def view(self) -> dict[str, object]:
        """The ``sleep`` part of this upstream's /status entry."""
        return {"state": self.state, "detail": self.detail, "last_wake_s": self.last_wake_s}


ADAPTER = Adapter(name="vllm", table=TABLE, cut_is_uncertain=True, make_controller=VllmController)
