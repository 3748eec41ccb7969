"""``GET /``: the owner's status page, one self-contained HTML document.

The page holds no data of its own: its script reads ``/status`` and follows ``/events`` with
the same scopes as any other client, so what it shows needs the read scope (or a trusted
loopback peer). A browser on another machine cannot attach a bearer token to a page load, so
the page itself is served without one and asks for a read token when ``/status`` answers 401.

Nothing is loaded from elsewhere (no fonts, scripts or styles from a CDN): it works offline,
and a Content-Security-Policy built from the hashes of its own inline script and style lets
the browser run only those, connect only back to this listener, and refuse framing.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib import resources

from aiohttp import web

_PAGE = "status_page.html"


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@cache
def _page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy (read once from the package)."""
    html = resources.files("vacancyd.api").joinpath(_PAGE).read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, flags=re.S)
    csp = "; ".join(
        [
            "default-src 'none'",
            "script-src " + " ".join(_sha256(s) for s in scripts),
            "style-src " + " ".join(_sha256(s) for s in styles),
            "connect-src 'self'",
            "img-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return html.encode(), csp


async def status_page(_: web.Request) -> web.Response:
    """The status page (200, ``text/html``)."""
    body, csp = _page()
    return web.Response(
        body=body,
        content_type="text/html",
        charset="utf-8",
        headers={
            "Content-Security-Policy": csp,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
        },
    )
