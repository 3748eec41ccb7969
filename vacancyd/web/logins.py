"""Single-use login links for the status page (``vacancyd open``; THREAT_MODEL.md).

A caller holding the read scope asks ``POST /login/ticket`` for a ticket: 32 random bytes,
valid for :data:`TICKET_TTL_S` seconds and for one use. ``vacancyd open`` hands the browser
``/#login=TICKET``; the page sends the ticket to ``POST /login`` and gets a session token
(read scope only, :data:`SESSION_TTL_S` seconds) that it keeps in ``sessionStorage`` and
sends as a bearer token, exactly as a pasted token. No cookie is involved: a cookie for
``127.0.0.1`` would also be sent to every other port on that address, including servers
other local users run, and would ride along with requests other pages make.

A link passes through the browser's command line, which other local users can read in
``/proc``. So on Linux a ticket is bound to the user who asked for it (``root`` may ask for
another user: ``sudo vacancyd open`` asks for the user who ran sudo), and only a connection
owned by that user may redeem it. The owner of a loopback TCP connection is read from the
kernel's socket table (``/proc/net/tcp`` and ``tcp6``, the ``uid`` column), which needs no
privilege. Where that cannot be read (not Linux, a remote peer) the ticket is unbound and
protected by its lifetime and single use alone.

Times are monotonic seconds. Nothing here survives a restart: a restarted daemon forgets
its sessions and the page asks for a new link.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

#: Seconds a login ticket may wait for its browser.
TICKET_TTL_S = 60.0
#: Seconds a page's session lasts.
SESSION_TTL_S = 12 * 3600.0
#: Tickets and sessions kept at once; the oldest goes first.
MAX_TICKETS = 32
MAX_SESSIONS = 64
#: What a session grants: the status page reads, nothing else.
SESSION_SCOPES = frozenset({"read"})

PROC_NET = Path("/proc/net")


@dataclass(frozen=True, slots=True)
class _Ticket:
    expires_at: float
    uid: int | None


class TicketRefused(Exception):
    """A ticket that cannot be redeemed; the message says why, for the page."""


class Logins:
    """Tickets and the sessions they turned into (see the module docstring)."""

    def __init__(self) -> None:
        self._tickets: OrderedDict[str, _Ticket] = OrderedDict()
        self._sessions: OrderedDict[str, float] = OrderedDict()

    def mint(self, now: float, uid: int | None) -> str:
        """A new ticket valid until ``now + TICKET_TTL_S``, bound to ``uid`` (None: unbound)."""
        self._forget(now)
        ticket = secrets.token_urlsafe(32)
        self._tickets[ticket] = _Ticket(now + TICKET_TTL_S, uid)
        while len(self._tickets) > MAX_TICKETS:
            self._tickets.popitem(last=False)
        return ticket

    def redeem(self, ticket: str, now: float, uid: int | None) -> str:
        """Use ``ticket`` from a connection owned by ``uid``; returns a session token.
        Raises :class:`TicketRefused` for an unknown, used or expired ticket, or one bound
        to another user (which stays usable by its own user)."""
        self._forget(now)
        found = self._tickets.get(ticket)
        if found is None:
            raise TicketRefused(
                "this login link was used already or has expired: run `vacancyd open` again"
            )
        if found.uid is not None and uid != found.uid:
            raise TicketRefused(
                "this login link belongs to another local user"
                if uid is not None
                else "this login link is for a local user, and the connection's user is unknown"
            )
        del self._tickets[ticket]
        session = secrets.token_urlsafe(32)
        self._sessions[session] = now + SESSION_TTL_S
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session

    def session_valid(self, token: bytes, now: float) -> bool:
        """Whether ``token`` is a live session (compared in constant time per session)."""
        valid = False
        for session, expires_at in self._sessions.items():
            if secrets.compare_digest(session.encode(), token) and expires_at > now:
                valid = True
        return valid

    def _forget(self, now: float) -> None:
        for ticket in [t for t, v in self._tickets.items() if v.expires_at <= now]:
            del self._tickets[ticket]
        for session in [s for s, exp in self._sessions.items() if exp <= now]:
            del self._sessions[session]


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as the kernel's socket table writes it: 32-bit words in host (little
    endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _plain(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    addr = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def connection_uid(
    peer: tuple[str, int], local: tuple[str, int], proc_net: Path = PROC_NET
) -> int | None:
    """The user owning the socket at ``peer`` connected to ``local`` (this daemon's end),
    from ``/proc/net/tcp`` and ``tcp6``; None when not found or not readable. Blocking
    (reads files): call it off the event loop."""
    try:
        want_peer = (_plain(peer[0]), int(peer[1]))
        want_local = (_plain(local[0]), int(local[1]))
    except ValueError:
        return None
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text(encoding="ascii").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8:
                continue
            try:
                laddr, lport = fields[1].split(":")
                raddr, rport = fields[2].split(":")
                if (_address(laddr), int(lport, 16)) == want_peer and (
                    _address(raddr),
                    int(rport, 16),
                ) == want_local:
                    return int(fields[7])
            except ValueError:
                continue
    return None
