"""A TCP site with a cap on open connections (docs/architecture.md: listener protections).

aiohttp's own ``keepalive_timeout`` closes a connection whose handler is waiting for a
request (a fresh connection that has not completed its headers, or an idle keep-alive one),
so the runner sets it to ``header_read_timeout_s``; this site adds the connection cap.
Past the cap a new connection gets a short 503 and is closed.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from vacancyd.core.reasons import ErrorCode, ErrorType
from vacancyd.core.refusal import error_body


def _over_cap_response() -> bytes:
    body = json.dumps(
        error_body(
            "No vacancy: too many open connections to this listener",
            ErrorType.NO_VACANCY,
            ErrorCode.CONNECTION_LIMIT,
        )
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        "Retry-After: 2\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


class _OverCap(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_over_cap_response())
        transport.close()


class CappedTCPSite(web.TCPSite):
    """``web.TCPSite`` that accepts at most ``max_connections`` concurrent connections."""

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int
    ) -> None:
        super().__init__(runner, host, port)  # shutdown_timeout lives on the runner
        self._max_connections = max_connections

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        cap = self._max_connections

        def factory() -> asyncio.Protocol:
            if len(server.connections) >= cap:
                return _OverCap()
            return server()

        self._server = await loop.create_server(
            factory, self._host, self._port, backlog=self._backlog
        )
        self._bound_port = (
            self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
        )

    @property
    def listening(self) -> asyncio.AbstractServer | None:
        """The asyncio server accepting this site's connections (None before start)."""
        return self._server
