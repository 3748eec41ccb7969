"""Small JSON documents in the state directory, written so a crash never leaves half a file.

A write goes to a temporary file in the same directory, is flushed and fsynced, renamed over
the old file, and the directory is fsynced, so after a crash the file holds either the old
document or the new one. Used for the owner's pause (``STATE_DIR/pause.json``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (mode 0600). Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def remove(path: Path) -> bool:
    """Delete ``path`` durably; False when it did not exist. Raises OSError otherwise."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    _fsync_dir(path.parent)
    return True


def read_json(path: Path) -> Any | None:
    """The JSON document at ``path``, or None when there is no file.

    Raises ValueError (saying why) when the file exists but cannot be read or parsed.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
