"""What every table's model shares: the strict base model, names, listen addresses and
secret files."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from vacancyd.config.files import read_regular_file

Scope = Literal["borrow", "read", "admin", "probe"]
NAME_PATTERN = r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
#: A Kubernetes DNS-1123 label (namespace, Service name).
DNS_LABEL_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"


class FrozenModel(BaseModel):
    """The base of every table's model: unknown keys are errors and instances are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def split_listen(value: str) -> tuple[str, int]:
    """Parse ``host:port`` or ``[v6]:port`` into (host, port); raises ValueError."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"port {port_s!r} is not a number") from None
    if not 0 <= port < 65536:
        raise ValueError(f"port {port} is out of range 0-65535 (0 picks a free port)")
    return host, port


def is_loopback(host: str) -> bool:
    """True for loopback addresses and the name ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Secrets are short; a token file larger than this is a mistake (or /dev/urandom).
SECRET_FILE_MAX_BYTES = 64 * 1024
#: Seconds a followed lender's listeners keep answering after SIGTERM (the default
#: ``shutdown_delay_s`` with ``[kubernetes]``, and the least whenever an ``/events`` follower
#: is connected at the stop): what being published not-ready takes to reach kube-proxy.
FOLLOWED_SHUTDOWN_DELAY_S = 2.0


def read_secret_file(path: Path) -> str:
    """Read a token or credential file: a regular file of at most 64 KiB, UTF-8, stripped.

    Raises ValueError (with the reason) for anything else, including I/O errors; a FIFO or
    a device is refused at once (:func:`vacancyd.config.files.read_regular_file`).
    """
    data = read_regular_file(path, SECRET_FILE_MAX_BYTES)
    try:
        secret = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not secret:
        raise ValueError(f"{path} is empty")
    return secret


def secret_path(path: Path, credentials: Path | None) -> Path:
    """Where a token or credential file is read from.

    Under the systemd unit (``credentials``: the service's ``$CREDENTIALS_DIRECTORY``) a
    secret file is passed with ``LoadCredential=`` as the credential named after its file
    name, so ``/etc/vacancyd/tokens/admin.token`` is read from
    ``$CREDENTIALS_DIRECTORY/admin.token`` when that credential exists; otherwise (no
    credentials, or none of that name) from ``path`` itself.
    """
    if credentials is not None:
        candidate = credentials / path.name
        if os.path.exists(candidate):  # False also when the directory cannot be searched
            return candidate
    return path


def check_listen(value: str) -> str:
    """Validate a ``listen`` key: ``HOST:PORT`` with an IP address or ``localhost`` as HOST;
    raises ValueError naming what is wrong."""
    host, _ = split_listen(value)
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"listen host {host!r} must be an IP address or localhost") from None
    return value
