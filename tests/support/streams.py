"""Reading replies the way a borrower would: a whole (possibly cut) body, and SSE events."""

from __future__ import annotations

import asyncio
import json

import aiohttp


async def read_all(resp: aiohttp.ClientResponse) -> tuple[bytes, BaseException | None]:
    """Every byte of ``resp``'s body and the error that ended it early (None: a clean end).
    Closes the response."""
    data = b""
    try:
        async for chunk in resp.content.iter_any():
            data += chunk
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        return data, exc
    finally:
        resp.close()
    return data, None


async def read_event(
    stream: aiohttp.StreamReader, timeout_s: float = 5
) -> tuple[str, dict[str, object]]:
    """The next ``event:``/``data:`` pair of an SSE stream, the data parsed as JSON; raises
    TimeoutError after ``timeout_s`` seconds."""
    kind, data = "", ""
    async with asyncio.timeout(timeout_s):
        while True:
            line = (await stream.readline()).decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
            elif line == "" and kind:
                payload = json.loads(data)
                assert isinstance(payload, dict)
                return kind, payload


async def next_event(
    stream: aiohttp.StreamReader, wanted: str, timeout_s: float = 10
) -> dict[str, object]:
    """The payload of the next ``wanted`` event on an SSE stream (others are skipped)."""
    async with asyncio.timeout(timeout_s):
        while True:
            kind, payload = await read_event(stream, timeout_s)
            if kind == wanted:
                return payload
