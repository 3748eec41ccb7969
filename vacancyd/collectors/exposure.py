"""Read the socket table for :mod:`vacancyd.core.exposure` (blocking: run it in a thread)."""

from __future__ import annotations

import socket
from collections.abc import Iterable

import psutil

from vacancyd.core.exposure import Exposure, ListenerExposure, classify


def _resolve(host: str) -> list[str]:
    if host.lower() == "localhost":
        return ["127.0.0.1", "::1"]
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


def observe_targets(targets: Iterable[tuple[str, str, int]]) -> dict[str, Exposure]:
    """Exposure per upstream for ``(upstream, host, port)`` targets. One socket-table read;
    a failed read makes every observable target ``unknown`` with the error as detail."""
    wanted = list(targets)
    local = {
        addr.address.split("%", 1)[0]
        for addrs in psutil.net_if_addrs().values()
        for addr in addrs
        if addr.family in (socket.AF_INET, socket.AF_INET6)
    }
    try:
        listening = [
            (c.laddr.ip, c.laddr.port)
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr
        ]
        error = None
    except (psutil.Error, OSError) as exc:
        listening, error = [], f"cannot read the socket table: {exc}"
    found: dict[str, Exposure] = {}
    for upstream, host, port in wanted:
        verdict = classify(_resolve(host), port, local, listening)
        if error is not None and verdict.state is not ListenerExposure.NOT_OBSERVABLE:
            verdict = Exposure(ListenerExposure.UNKNOWN, error)
        found[upstream] = verdict
    return found
