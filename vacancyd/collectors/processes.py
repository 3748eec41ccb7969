"""Owner-process scan: which configured programs a desktop user is running.

Blocking (it walks /proc through psutil), so the logind collector runs it in a thread under
its deadline, and only for users of an unlocked, otherwise idle local session
(``vacancyd.core.presence.users_to_scan``).
"""

from __future__ import annotations

import logging
import os
import pwd
from collections.abc import Iterable

import psutil

from vacancyd.core.presence import ProcessScan

log = logging.getLogger(__name__)


def resolve_user(uid: int, user: str) -> str | None:
    """Check logind's (uid, user name) against the host's user database.

    Returns None when ``user`` resolves to ``uid``, else a sentence saying what is wrong. The
    scan matches processes by uid; a name that does not resolve to it means vacancyd and
    logind disagree about who is at the desktop, so nothing about the user can be trusted.
    """
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return f"user {user!r} (uid {uid}) does not resolve on this host"
    except OSError as exc:  # NSS backends can fail (an unreachable directory server)
        return f"user {user!r} (uid {uid}) could not be looked up: {exc}"
    if entry.pw_uid != uid:
        return f"user {user!r} resolves to uid {entry.pw_uid}, logind says uid {uid}"
    return None


def _names_of(info: dict[str, object]) -> set[str]:
    names = set()
    name = info.get("name")
    if isinstance(name, str) and name:
        names.add(name)
    cmdline = info.get("cmdline")
    if isinstance(cmdline, list) and cmdline and isinstance(cmdline[0], str) and cmdline[0]:
        names.add(os.path.basename(cmdline[0]))
    return names


def scan_owner_processes(users: Iterable[tuple[int, str]], names: frozenset[str]) -> ProcessScan:
    """Match ``names`` against the processes of ``users`` ((uid, user name) pairs).

    A process matches when its name or the base name of its first command-line argument equals
    a configured name exactly (Linux truncates the kernel's name to 15 characters; the command
    line keeps it whole). Processes are attributed by real uid. Never raises: a user that does
    not resolve, or a scan that fails, is reported in ``ProcessScan.problems``.
    """
    wanted: dict[int, str] = {}
    problems: dict[int, str] = {}
    for uid, user in users:
        why = resolve_user(uid, user)
        if why is None:
            wanted[uid] = user
        else:
            log.debug("owner-process scan: %s", why)
            problems[uid] = why
    matches: dict[int, set[str]] = {}
    if wanted and names:
        try:
            for proc in psutil.process_iter(["name", "cmdline", "uids"], ad_value=None):
                info = proc.info
                uids = info.get("uids")
                if uids is None or uids.real not in wanted:
                    continue
                found = _names_of(info) & names
                if found:
                    matches.setdefault(uids.real, set()).update(found)
        except (psutil.Error, OSError) as exc:
            log.warning("owner-process scan failed: %s; idle desktops count as the owner", exc)
            for uid in wanted:
                problems[uid] = f"process scan failed: {exc}"
    return ProcessScan(
        matches={uid: frozenset(found) for uid, found in matches.items()}, problems=problems
    )


def scan_running(names: frozenset[str]) -> frozenset[str]:
    """Which of ``names`` any process on the host is running, whoever owns it (exclusive
    apps hold lending for everyone). Matched like :func:`scan_owner_processes`. Raises
    OSError or psutil.Error when the process table cannot be read."""
    found: set[str] = set()
    for proc in psutil.process_iter(["name", "cmdline"], ad_value=None):
        found.update(_names_of(proc.info) & names)
    return frozenset(found)
