"""Talking to a running daemon's API from the command line: the address and token to use
(vacancyd.runtime.apitarget), TLS trust, requests, and the messages for failed calls."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def _opener(tls: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    # The daemon is a local service: never route this through an HTTP proxy.
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if tls is not None:
        handlers.append(urllib.request.HTTPSHandler(context=tls))
    return urllib.request.build_opener(*handlers)


def _client_tls(args: argparse.Namespace, what: str) -> ssl.SSLContext | int | None:
    """The TLS context for talking to the API: trusting ``--ca-file`` (else
    ``$VACANCYD_CA_FILE``) when given, else the system's CAs (None). An exit code (2) after
    saying what was wrong when the bundle cannot be used."""
    from vacancyd.web.tls import CA_FILE_ENV, TlsError, client_context

    ca_file = getattr(args, "ca_file", None) or os.environ.get(CA_FILE_ENV) or None
    if ca_file is None:
        return None
    source = "--ca-file" if getattr(args, "ca_file", None) else f"${CA_FILE_ENV}"
    try:
        return client_context(Path(ca_file))
    except TlsError as exc:
        print(f"vacancyd {what}: {source}: {exc}", file=sys.stderr)
        return 2


def _unreachable(what: str, url: str, exc: BaseException, failed: str = "cannot reach") -> str:
    """The message for a failed call: a refused certificate says which problem it has and
    how to trust a private CA."""
    from vacancyd.web.tls import CA_FILE_ENV, verify_failure

    why = verify_failure(exc)
    if why is not None:
        return (
            f"vacancyd {what}: cannot verify the TLS certificate of {url}: {why}; if the "
            f"daemon's certificate is self-signed or from a private CA, pass --ca-file (or "
            f"set {CA_FILE_ENV}) with that certificate or CA"
        )
    return f"vacancyd {what}: {failed} {url}: {exc}"


def _fetch_status(
    url: str, token: str | None, timeout_s: float = 5.0, tls: ssl.SSLContext | None = None
) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/status")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with _opener(tls).open(request, timeout=timeout_s) as resp:
        data = json.load(resp)
    if not isinstance(data, dict) or not {"version", "resources", "upstreams"} <= data.keys():
        raise ValueError("the answer is not a vacancyd /status document (is this vacancyd's API?)")
    return data


def _target(args: argparse.Namespace, scope: str, what: str) -> Any:
    """The API and token for ``vacancyd WHAT`` (vacancyd.runtime.apitarget), or an exit code
    (2) after saying what was wrong."""
    from vacancyd.runtime.apitarget import TargetError, resolve

    try:
        return resolve(
            scope=scope,
            command=what,
            url=args.url,
            token=args.token,
            token_file=args.token_file,
            config=args.config,
        )
    except TargetError as exc:
        print(f"vacancyd {what}: {exc}", file=sys.stderr)
        return 2


def _http_refusal(what: str, url: str, exc: urllib.error.HTTPError, target: Any, scope: str) -> str:
    """One line for an HTTP error answer; a 401/403 says which token was sent and what to do."""
    from vacancyd.runtime.apitarget import unauthorized_hint

    detail = exc.read().decode("utf-8", "replace")[:500]
    try:
        detail = json.loads(detail)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    line = f"vacancyd {what}: {url} answered {exc.code}: {detail}"
    if exc.code in (401, 403):
        line += f"; {unauthorized_hint(target, scope, what)}"
    return line


def _post(
    url: str,
    token: str | None,
    body: dict[str, Any],
    timeout_s: float = 10.0,
    tls: ssl.SSLContext | None = None,
) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with _opener(tls).open(request, timeout=timeout_s) as resp:
        return json.load(resp)


def _admin_call(args: argparse.Namespace, what: str, path: str, body: dict[str, Any]) -> Any:
    target = _target(args, "admin", what)
    if isinstance(target, int):
        return target
    url = target.url
    tls = _client_tls(args, what)
    if isinstance(tls, int):
        return tls
    try:
        return _post(url + path, target.token, body, tls=tls)
    except urllib.error.HTTPError as exc:
        print(_http_refusal(what, url, exc, target, "admin"), file=sys.stderr)
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        print(_unreachable(what, url + path, exc), file=sys.stderr)
        return 1
