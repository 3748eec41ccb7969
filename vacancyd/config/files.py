"""Reading operator-named files without hanging or exhausting memory.

A path in a configuration may name anything: a FIFO (opening it for reading blocks until a
writer appears), a device (``/dev/zero`` never ends), a directory, or a huge file. Files are
therefore opened with ``O_NONBLOCK`` (a FIFO opens at once), checked with ``fstat`` to be
regular files, and read up to a size cap; anything else is a clear error at once.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "of another kind"


def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 else f"{n // 1024} KiB"


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The contents of the regular file ``path``, at most ``max_bytes`` bytes.

    Raises ValueError naming the path and the reason: it cannot be opened, it is not a
    regular file (FIFO, device, directory, socket), or it is larger than ``max_bytes``.
    Never blocks on a FIFO and never reads more than ``max_bytes + 1`` bytes.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file (it is {_kind(info.st_mode)})")
        if info.st_size > max_bytes:
            raise ValueError(f"{path} is larger than {_size(max_bytes)}")
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1024 * 1024, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if total > max_bytes:  # it grew while being read
        raise ValueError(f"{path} is larger than {_size(max_bytes)}")
    return b"".join(chunks)
