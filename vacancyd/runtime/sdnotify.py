"""systemd service notifications (sd_notify(3)) for ``Type=notify`` units.

When systemd starts vacancyd with ``NOTIFY_SOCKET`` set, the daemon sends ``READY=1`` once
every listener is bound (so dependent units and ``systemctl start`` wait for real readiness)
and ``STOPPING=1`` when it begins shutting down. Without ``NOTIFY_SOCKET`` nothing is sent.
A failed send is logged and otherwise ignored: notification must never stop the daemon.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


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
