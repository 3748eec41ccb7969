"""Whether an upstream's own server can be reached around the gate (pure).

A borrower who can connect to the inference server directly bypasses every check vacancyd
makes, so /status says, per upstream, what kind of socket serves its ``target``:

* ``loopback_only`` — every socket listening on the target's port is bound to a loopback
  address: only this machine can reach the server.
* ``listens_on_network`` — a socket on the target's port is bound to a wildcard
  (``0.0.0.0``, ``::``) or another non-loopback address: the network can reach it.
* ``unknown`` — no socket accepts the target's address and port (the server is not
  running), or the socket table could not be read.
* ``not_observable`` — the target is not a loopback address, ``localhost`` or an address
  of this machine, so no local socket describes it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class ListenerExposure(StrEnum):
    LOOPBACK_ONLY = "loopback_only"
    LISTENS_ON_NETWORK = "listens_on_network"
    UNKNOWN = "unknown"
    NOT_OBSERVABLE = "not_observable"


@dataclass(frozen=True, slots=True)
class Exposure:
    """The verdict and a sentence saying what was seen (e.g. the exposed addresses)."""

    state: ListenerExposure
    detail: str


WILDCARDS = frozenset({"0.0.0.0", "::"})


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _accepts(bound: str, target: str) -> bool:
    """True when a socket bound to ``bound`` accepts connections to ``target``."""
    if bound == target:
        return True
    if bound == "::":  # dual-stack: IPv4 too, unless the host sets bindv6only
        return True
    return bound == "0.0.0.0" and ":" not in target


def classify(
    target_addresses: Iterable[str],
    port: int,
    local_addresses: Iterable[str],
    listening: Iterable[tuple[str, int]],
) -> Exposure:
    """The exposure of a target that resolves to ``target_addresses`` on ``port``.

    ``local_addresses``: this machine's interface addresses; ``listening``: (address, port)
    of every listening TCP socket.
    """
    targets = {a for a in target_addresses}
    local = set(local_addresses)
    if not targets or not all(_is_loopback(a) or a in local for a in targets):
        return Exposure(
            ListenerExposure.NOT_OBSERVABLE,
            "the target is not an address of this machine; its socket cannot be seen here",
        )
    on_port = sorted({addr for addr, p in listening if p == port})
    serving = [addr for addr in on_port if any(_accepts(addr, t) for t in targets)]
    if not serving:
        return Exposure(ListenerExposure.UNKNOWN, f"nothing listens on port {port} for the target")
    exposed = [addr for addr in on_port if not _is_loopback(addr)]
    if exposed or any(not _is_loopback(t) for t in targets):
        shown = ", ".join(f"{a}:{port}" for a in exposed) or f"port {port}"
        return Exposure(
            ListenerExposure.LISTENS_ON_NETWORK,
            f"the server listens on {shown}: the network can reach it without the gate",
        )
    return Exposure(ListenerExposure.LOOPBACK_ONLY, f"listens on loopback only ({port})")
