"""Request body buffering within bounds (docs/architecture.md).

A work request's body is buffered so the model name can be read. Each body must fit
``max_request_body_mib`` (413, before reading when Content-Length says so); all bodies a
proxy holds at once must fit its budget (503 + Retry-After); the whole body must arrive within
``body_read_timeout_s`` and no gap between chunks may exceed ``body_idle_timeout_s`` (408).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from vacancyd.core.reasons import ErrorCode, Reason

MIB = 1024 * 1024
#: The budget a body holds grows in steps of this many bytes as its bytes arrive.
RESERVE_STEP_BYTES = 256 * 1024
#: A body larger than this is assembled on a worker thread (bytes).
JOIN_ON_LOOP_BYTES = 1024 * 1024


class BodyError(Exception):
    """A body could not be buffered. ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, code: ErrorCode | Reason, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class BodyBudget:
    """Bytes of request bodies one proxy may hold at once.

    ``copying`` is held while a large body is copied whole: joined from its chunks
    (:func:`read_body`) or read for its facts (``vacancyd.proxy.jobs``, whose parser builds
    the long values it scans). Those copies are not counted in the budget, so taking them one
    at a time bounds what the proxy holds beyond it to one body, however many arrive at once.
    """

    limit_bytes: int
    used_bytes: int = 0
    copying: asyncio.Lock = field(default_factory=asyncio.Lock)

    def try_reserve(self, n: int) -> bool:
        if self.used_bytes + n > self.limit_bytes:
            return False
        self.used_bytes += n
        return True

    def release(self, n: int) -> None:
        self.used_bytes = max(0, self.used_bytes - n)


class Reservation:
    """A share of the budget, held until the body has been forwarded; release is idempotent."""

    def __init__(self, budget: BodyBudget, n: int) -> None:
        self._budget, self._n = budget, n

    @property
    def bytes(self) -> int:
        return self._n

    def grow_to(self, n: int) -> bool:
        """Hold at least ``n`` bytes; False (and nothing more held) when the budget is full."""
        if n <= self._n:
            return True
        if not self._budget.try_reserve(n - self._n):
            return False
        self._n = n
        return True

    def shrink(self, n: int) -> None:
        if n < self._n:
            self._budget.release(self._n - n)
            self._n = n

    def release(self) -> None:
        self._budget.release(self._n)
        self._n = 0


#: Content-Encoding values that mean "not encoded".
_IDENTITY = frozenset({"", "identity"})


def check_forwarded_body(request: web.BaseRequest, max_bytes: int) -> None:
    """Rules for a body the proxy forwards without reading it (pass-through, management).

    Raises :class:`BodyError`: 400 for a body on GET or HEAD (such a body has no meaning, and
    a server that ignores it would read it as the next request on a pooled connection); 415
    for an encoded body (aiohttp would decompress it, so a small compressed body could
    deliver gigabytes upstream); 413 when Content-Length exceeds ``max_bytes``.
    """
    if not request.body_exists:
        return
    if request.method in ("GET", "HEAD"):
        raise BodyError(
            400,
            ErrorCode.BODY_NOT_ALLOWED,
            f"a {request.method} request must not carry a body on this route",
        )
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in _IDENTITY:
        raise BodyError(
            415,
            ErrorCode.ENCODED_BODY_NOT_ALLOWED,
            f"Content-Encoding {encoding!r} is not accepted on this route; send the body as is",
        )
    check_declared_length(request, max_bytes)


def check_declared_length(request: web.BaseRequest, max_bytes: int) -> None:
    """Refuse early (413) when Content-Length already exceeds the limit."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise BodyError(
            413,
            ErrorCode.REQUEST_TOO_LARGE,
            f"request body of {declared} bytes exceeds the {_size(max_bytes)} limit",
        )


async def read_body(
    request: web.BaseRequest,
    *,
    max_bytes: int,
    budget: BodyBudget,
    read_timeout_s: float,
    idle_timeout_s: float,
) -> tuple[bytes, Reservation]:
    """Buffer the body. Returns it with its budget reservation; raises :class:`BodyError`.

    The reservation grows with the bytes that have arrived, :data:`RESERVE_STEP_BYTES` at a
    time (never past ``max_bytes``), so a body trickled in slowly holds only what it sent,
    whatever its Content-Length promises: a few slow uploads cannot starve every other
    borrower of the budget. A body that would overflow the budget mid-way gets 503.
    """
    check_declared_length(request, max_bytes)
    reservation = Reservation(budget, 0)
    if not request.body_exists:
        return b"", reservation
    if not reservation.grow_to(min(RESERVE_STEP_BYTES, max_bytes)):
        raise _exhausted()
    chunks: list[bytes] = []
    total = 0
    content = request.content
    loop = asyncio.get_running_loop()
    deadline = loop.time() + read_timeout_s
    try:
        while True:
            remaining = deadline - loop.time()
            wait = min(idle_timeout_s, remaining)
            if wait <= 0:
                raise BodyError(
                    408, ErrorCode.BODY_TIMEOUT, f"body not received within {read_timeout_s:g} s"
                )
            try:
                if content.is_eof():
                    chunk = await content.readany()  # all of it is here: never waits
                else:
                    async with asyncio.timeout(wait):
                        chunk = await content.readany()
            except RequestPayloadError as exc:
                raise BodyError(
                    400,
                    ErrorCode.INVALID_REQUEST_BODY,
                    f"request body could not be read: {exc.__cause__ or exc}",
                ) from exc
            except TimeoutError:
                if wait < idle_timeout_s:
                    raise BodyError(
                        408,
                        ErrorCode.BODY_TIMEOUT,
                        f"body not received within {read_timeout_s:g} s",
                    ) from None
                raise BodyError(
                    408, ErrorCode.BODY_IDLE, f"no body data for {idle_timeout_s:g} s"
                ) from None
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:
                raise BodyError(
                    413,
                    ErrorCode.REQUEST_TOO_LARGE,
                    f"request body exceeds the {_size(max_bytes)} limit",
                )
            if total > reservation.bytes:
                step = -(-total // RESERVE_STEP_BYTES) * RESERVE_STEP_BYTES
                if not reservation.grow_to(min(step, max_bytes)):
                    raise _exhausted()
            chunks.append(chunk)
    except BaseException:
        # The error's traceback keeps this frame alive while the caller answers and drains
        # the rest of the body: let go of what arrived now, as the budget already does.
        chunks.clear()
        reservation.release()
        raise
    reservation.shrink(total)
    if total <= JOIN_ON_LOOP_BYTES:
        return b"".join(chunks), reservation
    try:
        async with budget.copying:
            # Copying tens of MiB takes tens of ms; bytes.join releases the GIL for large
            # buffers. The chunks go before the next body may copy (see BodyBudget).
            body = await asyncio.to_thread(b"".join, chunks)
            chunks.clear()
    except BaseException:
        chunks.clear()
        reservation.release()
        raise
    return body, reservation


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // 1024} KiB"


def _exhausted() -> BodyError:
    return BodyError(
        503, Reason.BODY_BUDGET_EXHAUSTED, "the proxy is buffering too many request bodies"
    )


async def drain(request: web.BaseRequest, limit_bytes: int, timeout_s: float) -> None:
    """Read and drop what is left of a refused request's body, at most ``limit_bytes``.

    This lets a client that is still sending receive the refusal rather than a reset.
    """
    if request.content.is_eof():
        return
    seen = 0
    try:
        async with asyncio.timeout(timeout_s):
            while seen <= limit_bytes:
                chunk = await request.content.readany()
                if not chunk:
                    return
                seen += len(chunk)
    except (TimeoutError, ConnectionError, RequestPayloadError):
        return
