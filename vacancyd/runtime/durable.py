"""Durable state: small JSON files in the state directory that survive restarts and crashes.

Every file is one JSON object with an integer ``"version"`` naming its format. It is written
atomically: the new content goes to a temporary file in the same directory, is flushed and
fsynced, renamed over the old file, and the directory is fsynced, so a crash (or ``kill -9``)
at any moment leaves either the old file or the new one, never a mix.

Reading distinguishes "absent" (None: nothing was learned yet) from "present but unusable":
a file that cannot be read, is not JSON, is not an object, or has a version this vacancyd
does not know (for example one written by a newer release) raises :class:`StateFileError`
naming the file. Callers then refuse what depends on it rather than guess; see
docs/footprints.md ("Durable state"). A file that cannot be written (read-only directory,
full disk) raises ``OSError`` from :func:`write_state`; the daemon logs it and keeps serving
from memory.

Layout under ``state_dir``: ``calibration/RESOURCE.json`` (GPU pressure calibration),
``residency/UPSTREAM.json`` (the Ollama learned context map), ``footprints/UPSTREAM.json``
(learned footprint priors), ``holds.json`` (jobs held for uncertain completion),
``pause.json`` (the owner's pause, :class:`vacancyd.runtime.daemon.DurablePauseStore`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class StateFileError(Exception):
    """A durable state file exists but cannot be used; ``path`` names it."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


def read_state(path: Path, versions: frozenset[int] | set[int]) -> dict[str, Any] | None:
    """The object in ``path``, or None when the file does not exist.

    ``versions``: the format versions the caller understands. Raises
    :class:`StateFileError` for an unreadable, truncated or corrupt file, one that is not a
    JSON object, or one whose ``version`` is not in ``versions``.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None  # nothing there (NotADirectory: not even the directory it would be in)
    except (OSError, UnicodeDecodeError) as exc:
        raise StateFileError(path, f"cannot be read: {exc}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise StateFileError(path, f"is corrupt or truncated (not valid JSON: {exc})") from exc
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


def write_state(path: Path, data: Mapping[str, Any]) -> None:
    """Replace ``path`` with ``data`` as JSON, atomically. Raises OSError when it cannot."""
    write_text(path, json.dumps(data, separators=(",", ":")))


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
