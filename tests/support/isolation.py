"""Run a command where vacancyd's embedded default configuration cannot touch the machine.

The embedded default listens on fixed ports (9470, 9480), so a test that runs it beside a
real daemon would collide with it; its state goes to the user's state directory, and /var/lib
is covered too so that a regression writing there cannot touch a real daemon's state.
:func:`isolated` wraps a command so that it runs in private network and mount namespaces
(``unshare(1)``, as a mapped root when not already root): only a loopback interface,
brought up here, is visible, and a scratch directory is mounted over /var/lib. Nothing
outside can reach the command's listeners, so the test's own client must run inside too
(as part of the command).

``python -m tests.support.isolation VAR_LIB CMD...`` is the part that runs inside: it brings
``lo`` up, bind-mounts VAR_LIB over /var/lib and executes CMD.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_MS_BIND = 4096


def unshare_argv() -> list[str]:
    """``unshare`` with new network and mount namespaces (and a user namespace when not
    root). Raises OSError naming what is missing when namespaces cannot be made here."""
    tool = shutil.which("unshare")
    if tool is None:
        raise OSError("unshare(1) (util-linux) is not installed")
    argv = [tool, "--net", "--mount"]
    if os.geteuid() != 0:
        argv += ["--user", "--map-root-user"]
    probe = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        raise OSError(f"cannot create network and mount namespaces: {probe.stderr.strip()}")
    return argv


def isolated(argv: list[str], var_lib: Path) -> list[str]:
    """``argv`` run in private namespaces with ``var_lib`` mounted over /var/lib.
    Raises OSError when namespaces cannot be made on this machine."""
    var_lib.mkdir(parents=True, exist_ok=True)
    inside = [sys.executable, "-m", "tests.support.isolation", str(var_lib), *argv]
    return [*unshare_argv(), *inside]


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def _bind_mount(source: Path, target: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(str(source).encode(), str(target).encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount {source} over {target}: {os.strerror(err)}")


def main(args: list[str]) -> None:
    var_lib, argv = Path(args[0]), args[1:]
    _loopback_up()
    _bind_mount(var_lib, Path("/var/lib"))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
