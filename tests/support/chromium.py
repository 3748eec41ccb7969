"""Drive a real headless Chromium (Debian's ``chromium`` package) over the DevTools protocol.

Just enough of the Chrome DevTools Protocol (JSON messages over a WebSocket, see
https://chromedevtools.github.io/devtools-protocol/) to open a page, evaluate JavaScript in
it and take a PNG screenshot: ``Target.createTarget``, ``Target.attachToTarget`` (flat
sessions), ``Runtime.evaluate`` and ``Page.captureScreenshot``.

``chromium_page(url)`` yields a :class:`Page`; without a ``chromium`` binary the test is
skipped (failed with ``VACANCYD_REQUIRE_TOOLS=1``, where ``tools/dev`` installs it).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest


def chromium_binary() -> str:
    """The chromium executable, or skip (fail under ``VACANCYD_REQUIRE_TOOLS=1``)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    message = "chromium is not installed (apt-get install chromium)"
    if os.environ.get("VACANCYD_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


class Page:
    """One browser tab attached through a flat DevTools session."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, session_id: str) -> None:
        self._ws = ws
        self._session = session_id
        self._ids = itertools.count(1000)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        return await _call(self._ws, self._ids, method, params, session_id=self._session)

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` evaluated in the page (promises awaited)."""
        reply = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise AssertionError(f"page threw: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 10.0) -> Any:
        """Poll ``expression`` until it is truthy; returns its value."""
        last: Any = None
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    last = await self.evaluate(expression)
                    if last:
                        return last
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise AssertionError(f"{expression} stayed {last!r} for {timeout_s} s") from None

    async def screenshot(self, path: Path) -> Path:
        reply = await self.call("Page.captureScreenshot", format="png")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(reply["data"]))
        return path


async def _call(
    ws: aiohttp.ClientWebSocketResponse,
    ids: itertools.count[int],
    method: str,
    params: dict[str, Any],
    session_id: str | None = None,
) -> dict[str, Any]:
    msg_id = next(ids)
    msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
    if session_id:
        msg["sessionId"] = session_id
    await ws.send_str(json.dumps(msg))
    async with asyncio.timeout(15):
        while True:
            raw = await ws.receive()
            if raw.type is not aiohttp.WSMsgType.TEXT:
                raise AssertionError(f"DevTools socket ended: {raw.type}")
            reply = json.loads(raw.data)
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result


@asynccontextmanager
async def chromium_page(url: str, width: int = 1200, height: int = 900) -> AsyncIterator[Page]:
    """A headless Chromium with one tab open on ``url``."""
    binary = chromium_binary()
    with tempfile.TemporaryDirectory(prefix="vacancyd-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            binary,
            "--headless=new",
            "--no-sandbox",  # tests run as root, where Chromium's sandbox refuses to start
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stderr is not None
            endpoint = None
            async with asyncio.timeout(30):
                while endpoint is None:
                    line = (await proc.stderr.readline()).decode(errors="replace")
                    if not line:
                        raise AssertionError("chromium exited before it was ready")
                    found = re.search(r"DevTools listening on (ws://\S+)", line)
                    endpoint = found.group(1) if found else None
            async with (
                aiohttp.ClientSession() as http,
                http.ws_connect(endpoint, max_msg_size=64 * 1024 * 1024) as ws,
            ):
                ids = itertools.count(1)
                target = await _call(ws, ids, "Target.createTarget", {"url": "about:blank"})
                attached = await _call(
                    ws,
                    ids,
                    "Target.attachToTarget",
                    {"targetId": target["targetId"], "flatten": True},
                )
                page = Page(ws, attached["sessionId"])
                await page.call("Page.enable")
                await page.call("Runtime.enable")
                await page.call(
                    "Emulation.setDeviceMetricsOverride",
                    width=width,
                    height=height,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                await page.call("Page.navigate", url=url)
                # the page may drop its fragment once read (a login link does)
                await page.wait_for(
                    f"location.href.split('#')[0] === {json.dumps(url.split('#')[0])}"
                    " && document.readyState === 'complete'"
                )
                yield page
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
