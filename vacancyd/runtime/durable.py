"""Durable state: small JSON files in the state directory that survive restarts and crashes.

Every file is one JSON object with an integer ``"version"`` naming its format. It is written
atomically: the new content goes to a temporary file in the same directory, is flushed and
fsynced, renamed over the old file, and the directory is fsynced, so a crash (or ``kill -9``)
at any moment leaves either the old file or the new one, never a mix.

Reading distinguishes "absent" (None: nothing was learned yet) from "present but unusable":
a file that cannot be read, is not a regular file (a FIFO would block the read forever), is
larger than its limit (:data:`MAX_STATE_BYTES` unless the caller gives another), is not JSON
or nested too deeply, is not an object, or has a version this vacancyd does not know (for
example one written by a newer release) raises :class:`StateFileError` naming the file. The
limit keeps startup quick whatever the state directory holds: a file is never read past it.
A write whose content would exceed the limit fails like a full disk (``OSError``, EFBIG), so
vacancyd never writes a file it would refuse to read back. Callers then refuse what depends
on it rather than guess; see docs/footprints.md ("Durable state"). A file that cannot be
written (read-only directory, full disk) raises ``OSError`` from :func:`write_state`; the
daemon logs it, retries, and keeps serving from memory.

Layout under ``state_dir``: ``calibration/RESOURCE.json`` (GPU pressure calibration),
``residency/UPSTREAM.json`` (the Ollama learned context map), ``footprints/UPSTREAM.json``
(learned footprint priors), ``holds.json`` (jobs held for uncertain completion),
``pause.json`` (the owner's pause, :class:`vacancyd.runtime.daemon.DurablePauseStore`),
``power-limits.json`` (each GPU's own power limit while ``lend_power_limit_w`` is in force,
:mod:`vacancyd.runtime.powerlimit`).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The largest state file read or written, in bytes, unless the caller names another limit.
MAX_STATE_BYTES = 1024 * 1024


class StateFileError(Exception):
    """A durable state file exists but cannot be used; ``path`` names it."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


def read_text(path: Path, max_bytes: int = MAX_STATE_BYTES) -> str | None:
    """The UTF-8 text of ``path``, or None when it does not exist; never reads more than
    ``max_bytes`` + 1 bytes and never blocks on a FIFO or device.

    Raises :class:`StateFileError` for a file that is not a regular file, is over
    ``max_bytes``, cannot be read or is not UTF-8.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None  # nothing there (NotADirectory: not even the directory it would be in)
    except OSError as exc:
        raise StateFileError(path, f"cannot be read: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateFileError(path, "cannot be read: it is not a regular file")
        if info.st_size > max_bytes:
            raise StateFileError(path, _too_large(info.st_size, max_bytes))
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:  # it grew while being read
            raise StateFileError(path, _too_large(size, max_bytes))
        return b"".join(chunks).decode("utf-8")
    except OSError as exc:
        raise StateFileError(path, f"cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise StateFileError(path, f"cannot be read: it is not UTF-8 text ({exc})") from exc
    finally:
        os.close(fd)


def _too_large(size: int, max_bytes: int) -> str:
    return f"is {size} bytes, over the {max_bytes} byte limit for this file; it was not read"


def read_json(path: Path, max_bytes: int = MAX_STATE_BYTES) -> Any:
    """The JSON value in ``path`` (None when the file does not exist, and also when it holds
    JSON ``null``), read within ``max_bytes``. Raises :class:`StateFileError` as
    :func:`read_text` does, and for text that is not JSON or nests too deeply to parse."""
    text = read_text(path, max_bytes)
    if text is None:
        return None
    return _parse_json(path, text)


def _parse_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise StateFileError(path, f"is corrupt or truncated (not valid JSON: {exc})") from exc
    except RecursionError:
        raise StateFileError(path, "is not usable JSON (nested too deeply)") from None


def read_state(
    path: Path, versions: frozenset[int] | set[int], max_bytes: int = MAX_STATE_BYTES
) -> dict[str, Any] | None:
    """The object in ``path``, or None when the file does not exist.

    ``versions``: the format versions the caller understands; ``max_bytes``: the file's size
    limit. Raises :class:`StateFileError` for an unreadable, oversized, truncated or corrupt
    file, one that is not a JSON object, or one whose ``version`` is not in ``versions``.
    """
    text = read_text(path, max_bytes)
    if text is None:
        return None
    # parsed here, not by read_json: a file holding JSON ``null`` is unusable, not absent
    data = _parse_json(path, text)
    if not isinstance(data, dict):
        raise StateFileError(path, "is not a JSON object")
    version = data.get("version")
    if version not in versions:
        newest = max(versions)
        if isinstance(version, int) and not isinstance(version, bool) and version > newest:
            raise StateFileError(
                path,
                f"was written by a newer vacancyd (format version {version}; this one reads "
                f"up to {newest})",
            )
        raise StateFileError(path, f"has an unknown format version {version!r}")
    return data


def write_state(path: Path, data: Mapping[str, Any], max_bytes: int = MAX_STATE_BYTES) -> None:
    """Replace ``path`` with ``data`` as JSON, atomically. Raises OSError when it cannot,
    EFBIG when the JSON would be over ``max_bytes`` (the old file is kept)."""
    text = json.dumps(data, separators=(",", ":"))
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise OSError(
            errno.EFBIG, f"would be {size} bytes, over the {max_bytes} byte limit for {path.name}"
        )
    write_text(path, text)


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) so that a reader, or a crash, sees either the
    old file or the whole new one; the directory entry is synced too. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def remove_state(path: Path) -> None:
    """Remove ``path`` if it exists. Raises OSError when it cannot."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
