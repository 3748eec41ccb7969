"""systemd service notifications (sd_notify(3)) for ``Type=notify`` units.

When systemd starts vacancyd with ``NOTIFY_SOCKET`` set, the daemon sends ``READY=1`` once
every listener is bound (so dependent units and ``systemctl start`` wait for real readiness)
and ``STOPPING=1`` when it begins shutting down; meanwhile :func:`status_updates` keeps
``STATUS=`` (what ``systemctl status`` shows) current. Without ``NOTIFY_SOCKET`` nothing is
sent.
A failed send is logged and otherwise ignored: notification must never stop the daemon.

With ``WatchdogSec=`` in the unit, systemd sets ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``);
:func:`watchdog` then sends ``WATCHDOG=1`` from the event loop at half that period, so a
loop that stops running (a blocking call, a deadlock) stops the pings and systemd restarts
the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether a service manager listens (``NOTIFY_SOCKET`` is set)."""
    return bool(os.environ.get("NOTIFY_SOCKET"))


def notify(message: str) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``) to the service manager; True when sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("could not notify the service manager (%s): %s", message, exc)
        return False
    return True


def watchdog_interval_s() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WATCHDOG_USEC``), or None when the
    service manager expects none: no watchdog configured, or one meant for another process
    (``WATCHDOG_PID`` names a different pid). An unreadable value counts as none."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not os.environ.get("NOTIFY_SOCKET"):
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        period = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not a whole number of microseconds", usec)
        return None
    if period <= 0:
        return None
    return period / 2_000_000


async def watchdog(interval_s: float) -> None:
    """Ping the service manager every ``interval_s`` seconds from the running event loop."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)


#: Seconds between re-reads of the service status line; a change shows at most this late.
STATUS_PERIOD_S = 2.0


async def status_updates(
    describe: Callable[[], str], *, sent: str | None = None, period_s: float = STATUS_PERIOD_S
) -> None:
    """Keep ``STATUS=`` current: send ``describe()`` whenever it differs from the line last
    sent (``sent``: the one sent with ``READY=1``), checked every ``period_s`` seconds, so
    ``systemctl status`` says whether the lender lends, why not, and how many jobs run.
    Runs until cancelled."""
    last = sent
    while True:
        await asyncio.sleep(period_s)
        line = describe()
        if line != last:
            notify(f"STATUS={line}")
            last = line
