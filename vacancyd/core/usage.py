"""Borrowers and what was lent to them (pure): the unnamed borrower, one finished job's
ledger row, a group of rows, ``--since`` values, and the usage report's JSON
(docs/borrowers.md).

Times are wall-clock seconds since the epoch (a ledger outlives the process, so no
monotonic time); energy is in joules (kWh = J / 3.6e6); busy time in seconds.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: The unnamed borrower in code: whoever borrows with a ``[[server.tokens]]`` token, a
#: trusted loopback client that presents no borrower's token, an unauthenticated borrower.
UNNAMED = ""
#: How the unnamed borrower is shown (metrics labels, ``vacancyd usage``, /status). No
#: ``[[borrower]]`` may take this name.
UNNAMED_LABEL = "default"
#: What ``vacancyd usage --by`` groups by; each is also the group's key in the report.
GROUP_BY = ("borrower", "day", "model")
JOULES_PER_KWH = 3_600_000.0


def borrower_label(name: str) -> str:
    """How ``name`` is shown: itself, or :data:`UNNAMED_LABEL` for the unnamed borrower."""
    return name or UNNAMED_LABEL


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One finished borrowed job, as the usage ledger keeps it.

    ``borrower``: its name (``""`` unnamed). ``model``: as the request named it (None: none
    was read). ``resource``: the primary resource it ran on. ``started_at``/``ended_at``:
    wall seconds (admitted, ended). ``outcome``: how it ended, a
    :class:`~vacancyd.core.reasons.JobOutcome` value (the ``outcome`` of
    ``vacancyd_jobs_total``). Tokens as the server reported them and energy in joules, None
    when unknown; ``bytes_in``/``bytes_out``: request body bytes read from the borrower and
    reply bytes sent to it.
    """

    job_id: int
    borrower: str
    upstream: str
    model: str | None
    resource: str
    started_at: float
    ended_at: float
    outcome: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    energy_j: float | None = None
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(frozen=True, slots=True)
class UsageGroup:
    """The ledger's rows of one group (one borrower, local day or model).

    ``key``: the borrower's name (``""`` unnamed), the day (``YYYY-MM-DD``, the lender's
    local time) or the model (None: no model was read). ``requests``: jobs; ``busy_s``:
    their summed lives (s). Token and energy sums are None when no row of the group
    reported any.
    """

    key: str | None
    requests: int
    busy_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    energy_j: float | None = None


@dataclass(frozen=True, slots=True)
class Since:
    """Where a usage report starts: ``seconds`` before now, or the start of local ``day``
    (exactly one is set). ``text``: as it was given."""

    text: str
    seconds: float | None = None
    day: dt.date | None = None


_DURATION = re.compile(r"([0-9]{1,6})([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
#: A duration with more digits than :data:`_DURATION` takes: said to be too long.
_LONG_DURATION = re.compile(r"[0-9]{7,}[smhdw]")


def parse_since(text: str) -> Since:
    """``30m``, ``1h``, ``24h``, ``7d``, ``4w`` (ASCII digits and a unit: s, m, h, d, w) or
    a date ``YYYY-MM-DD`` (from its local midnight). Raises ValueError saying what is
    accepted."""
    spec = text.strip().lower()
    m = _DURATION.fullmatch(spec)
    if m is not None:
        seconds = int(m.group(1)) * _UNIT_S[m.group(2)]
        if seconds <= 0:
            raise ValueError(f"since {text!r} is no time at all: give more than 0")
        return Since(text, seconds=float(seconds))
    if _LONG_DURATION.fullmatch(spec):
        raise ValueError(
            f"since {text!r} is too far back: give at most 6 digits (999999w), or a date "
            "(YYYY-MM-DD)"
        )
    if _DATE.fullmatch(spec):
        try:
            return Since(text, day=dt.date.fromisoformat(spec))
        except ValueError:
            raise ValueError(f"since {text!r} is not a calendar date") from None
    raise ValueError(
        f"since {text!r} is neither a time back from now (30m, 1h, 24h, 7d, 4w) nor a date "
        "(YYYY-MM-DD)"
    )


def energy_kwh(energy_j: float | None) -> float | None:
    """Joules in kWh (None stays None)."""
    return None if energy_j is None else energy_j / JOULES_PER_KWH


def report_rows(
    groups: Sequence[UsageGroup],
    by: str,
    *,
    price_per_kwh: float | None = None,
    currency: str = "",
) -> list[dict[str, object]]:
    """The report's rows, one per group, in order: ``{BY: key, "requests", "busy_s",
    "prompt_tokens", "completion_tokens", "energy_j", "energy_kwh"}`` plus ``"cost"`` and
    ``"currency"`` when ``price_per_kwh`` is set (a cost is None where energy is). ``BY`` is
    ``by`` itself; the unnamed borrower's key is :data:`UNNAMED_LABEL`. Raises ValueError
    for an unknown ``by``."""
    if by not in GROUP_BY:
        raise ValueError(f"cannot group by {by!r}: choose one of {', '.join(GROUP_BY)}")
    rows: list[dict[str, object]] = []
    for g in groups:
        key = borrower_label(g.key or "") if by == "borrower" else g.key
        kwh = energy_kwh(g.energy_j)
        row: dict[str, object] = {
            by: key,
            "requests": g.requests,
            "busy_s": round(g.busy_s, 3),
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.completion_tokens,
            "energy_j": None if g.energy_j is None else round(g.energy_j, 3),
            "energy_kwh": None if kwh is None else round(kwh, 6),
        }
        if price_per_kwh is not None:
            row["cost"] = None if kwh is None else round(kwh * price_per_kwh, 4)
            row["currency"] = currency
        rows.append(row)
    return rows


def groups_from_rows(rows: object, by: str) -> list[UsageGroup]:
    """Read :func:`report_rows` output (a list of objects, as the usage API answers it)
    back into groups. Raises ValueError naming the first value of the wrong shape."""
    if not isinstance(rows, list):
        raise ValueError("rows is not a list")
    groups: list[UsageGroup] = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"rows[{i}] is not an object")
        key = row.get(by)
        if key is not None and not isinstance(key, str):
            raise ValueError(f"rows[{i}].{by} is not a string")
        groups.append(
            UsageGroup(
                key=key,
                requests=_count(row, "requests", i, optional=False) or 0,
                busy_s=_number(row, "busy_s", i, optional=False) or 0.0,
                prompt_tokens=_count(row, "prompt_tokens", i),
                completion_tokens=_count(row, "completion_tokens", i),
                energy_j=_number(row, "energy_j", i),
            )
        )
    return groups


def _count(row: Mapping[str, object], name: str, i: int, *, optional: bool = True) -> int | None:
    value = row.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"rows[{i}].{name} is not a count")
    return value


def _number(row: Mapping[str, object], name: str, i: int, *, optional: bool = True) -> float | None:
    value = row.get(name)
    if value is None and optional:
        return None
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"rows[{i}].{name} is not a non-negative number")
    return float(value)
