"""WebSocket tunnels (docs/architecture.md, last paragraphs).

An authenticated ``Connection: Upgrade`` / ``Upgrade: websocket`` request on a route the
adapter lists as a WebSocket (``Route.websocket``: ComfyUI's ``GET /ws`` progress channel,
which the borrower keeps whatever the gate says; upgrades elsewhere are refused before they
get here) is first handshaken with the upstream — so a refused upstream handshake is
answered as an error before the borrower is upgraded — and then relayed message by message
in both directions: every text and binary frame's payload is passed on unchanged (ComfyUI's
binary previews included), pings are answered on each leg by its own endpoint. Closing
either side closes the other, with the close code passed on; when vacancyd stops, both legs
get code 1001 (Going Away) once the drain is over, and no new tunnel opens after that. Each
listener caps its open tunnels (``websocket_max_tunnels``; a further upgrade is answered
503) and closes a tunnel that carried nothing either way for ``websocket_idle_timeout_s``
seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import WSMsgType, web
from multidict import CIMultiDict
from yarl import URL

from vacancyd.core.reasons import RETRY_AFTER_S, ErrorCode, ErrorType, Reason
from vacancyd.core.refusal import error_body

log = logging.getLogger(__name__)

#: Handshake headers aiohttp's client generates itself; the borrower's are not forwarded.
HANDSHAKE_HEADERS = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
    }
)
#: The close code a tunnel ends with when vacancyd stops (RFC 6455 §7.4.1, Going Away).
GOING_AWAY = 1001
#: Largest single message relayed (bytes); ComfyUI previews are well below this.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def is_upgrade(request: web.BaseRequest) -> bool:
    """True for a WebSocket upgrade request (RFC 6455 §4.1)."""
    upgrade = request.headers.get("Upgrade")
    if upgrade is None or upgrade.lower() != "websocket":
        return False  # the common case, answered without splitting Connection
    connection = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    return "upgrade" in connection


@dataclass(frozen=True, slots=True)
class TunnelLimits:
    """``max_tunnels`` open at once per listener; ``idle_timeout_s`` without any message."""

    max_tunnels: int = 32
    idle_timeout_s: float = 300.0


class Tunnels:
    """The open tunnels of one listener."""

    def __init__(self, limits: TunnelLimits) -> None:
        self.limits = limits
        self.open = 0
        #: Set when the daemon stops: every open tunnel ends with a 1001 close frame.
        self._going_away = asyncio.Event()
        self._closed = asyncio.Event()
        self._closed.set()

    async def close_all(self, timeout_s: float) -> int:
        """End every open tunnel with close code 1001 (Going Away, RFC 6455 §7.4.1) on both
        legs, and refuse new upgrades; waits up to ``timeout_s`` seconds for the tunnels'
        closing handshakes. Returns how many tunnels were open."""
        was_open = self.open
        self._going_away.set()
        if was_open:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._closed.wait()
        return was_open

    async def serve(
        self,
        request: web.BaseRequest,
        session: aiohttp.ClientSession,
        url: URL,
        out_headers: CIMultiDict[str],
        upstream: str,
    ) -> web.StreamResponse:
        if self._going_away.is_set():
            return web.json_response(
                error_body(
                    f"{upstream!r} is shutting down; no new WebSocket tunnels",
                    ErrorType.NO_VACANCY,
                    Reason.SHUTTING_DOWN,
                ),
                status=503,
                headers={"Retry-After": str(RETRY_AFTER_S[Reason.SHUTTING_DOWN])},
            )
        if self.open >= self.limits.max_tunnels:
            return web.json_response(
                error_body(
                    f"{upstream!r} already has {self.open} open WebSocket tunnels "
                    f"(websocket_max_tunnels = {self.limits.max_tunnels})",
                    ErrorType.NO_VACANCY,
                    ErrorCode.WEBSOCKET_TUNNELS_EXHAUSTED,
                ),
                status=503,
                headers={"Retry-After": "5"},
            )
        for name in list(out_headers):
            if name.lower() in HANDSHAKE_HEADERS:
                del out_headers[name]
        protocols = [
            p.strip()
            for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
            if p.strip()
        ]
        self.open += 1
        self._closed.clear()
        try:
            up: aiohttp.ClientWebSocketResponse | None = None
            try:
                up = await session.ws_connect(
                    url,
                    headers=out_headers,
                    protocols=protocols,
                    autoping=True,
                    max_msg_size=MAX_MESSAGE_BYTES,
                )
            except aiohttp.WSServerHandshakeError as exc:
                return web.json_response(
                    error_body(
                        f"the upstream of {upstream!r} refused the WebSocket handshake "
                        f"({exc.status})",
                        ErrorType.UPSTREAM,
                        ErrorCode.WEBSOCKET_HANDSHAKE_REFUSED,
                    ),
                    status=502,
                )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                return web.json_response(
                    error_body(
                        f"the upstream of {upstream!r} could not be reached: "
                        f"{exc.__class__.__name__}",
                        ErrorType.UPSTREAM,
                        ErrorCode.UPSTREAM_UNREACHABLE,
                    ),
                    status=502,
                )
            assert up is not None
            try:
                down = web.WebSocketResponse(
                    protocols=[up.protocol] if up.protocol else (),
                    autoping=True,
                    max_msg_size=MAX_MESSAGE_BYTES,
                )
                await down.prepare(request)
                await self._relay(down, up, upstream)
                return down
            finally:
                await up.close(code=GOING_AWAY if self._going_away.is_set() else 1000)
        finally:
            self.open -= 1
            if self.open == 0:
                self._closed.set()

    async def _relay(
        self, down: web.WebSocketResponse, up: aiohttp.ClientWebSocketResponse, name: str
    ) -> None:
        activity = asyncio.Event()

        async def pump(
            src: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
            dst: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
        ) -> int | None:
            async for msg in src:
                activity.set()
                if msg.type is WSMsgType.TEXT:
                    await dst.send_str(msg.data)
                elif msg.type is WSMsgType.BINARY:
                    await dst.send_bytes(msg.data)
                elif msg.type is WSMsgType.ERROR:
                    break
            return src.close_code

        async def idle() -> None:
            while True:
                activity.clear()
                try:
                    async with asyncio.timeout(self.limits.idle_timeout_s):
                        await activity.wait()
                except TimeoutError:
                    log.info(
                        "%s: WebSocket tunnel idle for %g s; closing",
                        name,
                        self.limits.idle_timeout_s,
                    )
                    return

        loop = asyncio.get_running_loop()
        tasks = {
            loop.create_task(pump(down, up), name=f"ws {name} borrower->upstream"),
            loop.create_task(pump(up, down), name=f"ws {name} upstream->borrower"),
            loop.create_task(idle(), name=f"ws {name} idle"),
        }
        going_away = loop.create_task(self._going_away.wait(), name=f"ws {name} going away")
        tasks.add(going_away)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        code = 1000
        for task in done:
            if not task.cancelled() and task.exception() is None:
                result = task.result()
                if isinstance(result, int):
                    code = result
        if code in (1004, 1005, 1006, 1015) or not 1000 <= code < 5000:
            code = 1000  # reserved codes cannot be sent in a close frame (RFC 6455 §7.4.1)
        if going_away in done:
            code = GOING_AWAY
            log.info("%s: WebSocket tunnel closed (1001): vacancyd is shutting down", name)
        why = b"vacancyd is shutting down" if code == GOING_AWAY else b""
        await down.close(code=code, message=why)
