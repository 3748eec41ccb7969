"""Kubernetes timestamps: epoch seconds to and from the second-precision UTC strings the
API server stores (``2026-11-29T14:02:30Z``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def rfc3339(now_wall: float) -> str:
    """Epoch seconds as the second-precision UTC time Kubernetes stores."""
    return datetime.fromtimestamp(now_wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(value: Any) -> float | None:
    """A Kubernetes timestamp (``2026-11-29T14:02:30Z``, or a datetime) as epoch seconds;
    None when it is missing or not a timestamp."""
    if isinstance(value, datetime):
        stamp = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return stamp.timestamp()
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def as_rfc3339(value: Any) -> str:
    """A timestamp as the server returned it (a string, or a datetime the client parsed)
    as the string Kubernetes stores."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        stamp: str = value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return stamp
    return str(value)
