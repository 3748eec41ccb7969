"""The owner's controls of a running daemon: ``vacancyd status | open | pause | resume``."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
from typing import Any

from vacancyd.cli.apiclient import (
    _admin_call,
    _client_tls,
    _fetch_status,
    _http_refusal,
    _post,
    _target,
    _unreachable,
)
from vacancyd.cli.render import format_status
from vacancyd.core.status import StatusDocument


def cmd_status(args: argparse.Namespace) -> int:
    target = _target(args, "read", "status")
    if isinstance(target, int):
        return target
    url = target.url
    tls = _client_tls(args, "status")
    if isinstance(tls, int):
        return tls
    try:
        raw = _fetch_status(url, target.token, tls=tls)
        # Read into the typed document: a wrong value is named by its path.
        doc = StatusDocument.from_json(raw)
    except urllib.error.HTTPError as exc:
        print(_http_refusal("status", url, exc, target, "read"), file=sys.stderr)
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        print(
            _unreachable("status", f"{url}/status", exc, "cannot read"),
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(raw, indent=2))
    else:
        print(format_status(doc))
    return 0


def _invoking_user() -> tuple[int, int] | None:
    """(uid, gid) of the user who ran ``sudo``, when this runs as root under sudo."""
    if os.geteuid() != 0:
        return None
    try:
        return int(os.environ["SUDO_UID"]), int(os.environ["SUDO_GID"])
    except (KeyError, ValueError):
        return None


def _launch_browser(url: str, user: tuple[int, int] | None) -> bool:
    """Hand ``url`` to the desktop's browser, as ``user`` when given (never a browser
    running as root); False when none could be started."""
    import shutil
    import subprocess
    import webbrowser

    if user is None:
        return webbrowser.open(url)
    opener = shutil.which("xdg-open")
    if opener is None:
        return False
    uid, gid = user
    runtime = f"/run/user/{uid}"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "XDG_RUNTIME_DIR": runtime,
        "DBUS_SESSION_BUS_ADDRESS": f"unix:path={runtime}/bus",
    }
    for key in ("DISPLAY", "WAYLAND_DISPLAY", "XAUTHORITY", "LANG"):
        if key in os.environ:
            env[key] = os.environ[key]
    try:
        subprocess.Popen(
            [opener, url],
            user=uid,
            group=gid,
            extra_groups=[],
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        return False
    return True


def cmd_open(args: argparse.Namespace) -> int:
    """Open the status page in the browser, logged in by a single-use link (no secret to
    paste; vacancyd.web.logins)."""
    target = _target(args, "read", "open")
    if isinstance(target, int):
        return target
    tls = _client_tls(args, "open")
    if isinstance(tls, int):
        return tls
    user = _invoking_user()
    body: dict[str, Any] = {} if user is None else {"for_uid": user[0]}
    try:
        answer = _post(target.url + "/login/ticket", target.token, body, tls=tls)
    except urllib.error.HTTPError as exc:
        print(_http_refusal("open", target.url, exc, target, "read"), file=sys.stderr)
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        print(_unreachable("open", target.url + "/login/ticket", exc), file=sys.stderr)
        return 1
    link = target.url + str(answer["path"])
    seconds = f"{float(answer.get('expires_in_s', 60)):.0f}"
    if not args.print and _launch_browser(link, user):
        print(f"vacancyd open: opened the status page in your browser ({target.url}/)")
        return 0
    print(link)
    print(
        f"vacancyd open: open this link in your browser within {seconds} s; it works once"
        + (" and only for your user" if user is not None or os.geteuid() != 0 else ""),
        file=sys.stderr,
    )
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    from vacancyd.core.pause import parse_duration

    body: dict[str, Any] = {}
    if args.for_ is not None:
        try:
            parse_duration(args.for_)  # say what is wrong before calling the daemon
        except ValueError as exc:
            print(f"vacancyd pause: --for: {exc}", file=sys.stderr)
            return 2
        body["for"] = args.for_
    if args.until is not None:
        body["until"] = args.until
    if args.until_idle:
        body["until_idle"] = True
    if args.reason:
        body["reason"] = args.reason
    answer = _admin_call(args, "pause", "/admin/pause", body)
    if isinstance(answer, int):
        return answer
    pause = answer.get("pause") or {}
    print(f"vacancyd: {pause.get('detail', 'paused')}")
    if not answer.get("persisted", True):
        print(
            f"vacancyd pause: warning: the pause was not saved and ends if the daemon restarts: "
            f"{answer.get('persist_error')}",
            file=sys.stderr,
        )
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    answer = _admin_call(args, "resume", "/admin/resume", {})
    if isinstance(answer, int):
        return answer
    print("vacancyd: lending resumed" if answer.get("resumed") else "vacancyd: was not paused")
    if answer.get("persist_error"):
        print(f"vacancyd resume: warning: {answer['persist_error']}", file=sys.stderr)
    return 0
