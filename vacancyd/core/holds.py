"""Owner holds: the owner's own controls that stop lending as if they were present (pure).

A *hold* is one reason the owner has declared that lending must stop now, apart from being
seen at the machine: outside the lending schedule, a pause, running on battery, an exclusive
application. Holds come from ``vacancyd.control.owner``, which evaluates the rules in
:mod:`vacancyd.core.schedule`, :mod:`~vacancyd.core.pause`, :mod:`~vacancyd.core.power` and
:mod:`~vacancyd.core.exclusive`.

A hold refuses new borrowed work with ``owner_active`` on every upstream it covers (whatever
its ``owner_scope``: these are the owner's explicit wishes, not presence evidence), and its
rising edge starts a reclaim exactly like the owner's return. A ``host`` hold covers every
upstream; a ``gpu`` hold (a GPU-exclusive application) covers upstreams that depend on a GPU
resource.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from vacancyd.core.reasons import Reason, Refuse

#: The longest Retry-After a hold suggests (seconds), even when it ends later.
MAX_RETRY_AFTER_S = 3600


class HoldKind(StrEnum):
    """Values appear in /status, metrics labels and refusal bodies."""

    SCHEDULE = "schedule"
    PAUSE = "pause"
    BATTERY = "battery"
    EXCLUSIVE_APP = "exclusive_app"


@dataclass(frozen=True, slots=True)
class Hold:
    """One active hold.

    ``resources``: the resources it covers, or None for the whole host. ``ends_in_s``:
    seconds until it ends by itself, when known (used for Retry-After). ``until``: wall-clock
    epoch seconds it ends at, when known (shown in refusals and /status).
    """

    kind: HoldKind
    detail: str
    resources: frozenset[str] | None = None
    ends_in_s: float | None = None
    until: float | None = None

    @property
    def key(self) -> str:
        return self.kind.value if self.resources is None else f"{self.kind.value}:gpu"

    def covers(self, resources: Iterable[str]) -> bool:
        return self.resources is None or not self.resources.isdisjoint(resources)


def retry_after_s(hold: Hold) -> int:
    """Retry-After for a refusal by ``hold``: when it ends, within 5 s to an hour."""
    if hold.ends_in_s is None:
        return 300 if hold.kind in (HoldKind.PAUSE, HoldKind.SCHEDULE) else 120
    return int(min(MAX_RETRY_AFTER_S, max(5.0, hold.ends_in_s + 1)))


def decide_holds(holds: Iterable[Hold], resources: Iterable[str]) -> Refuse | None:
    """The refusal for an upstream depending on ``resources`` while ``holds`` are active, or
    None when none of them covers it. The first covering hold names the refusal."""
    deps = tuple(resources)
    for hold in holds:
        if hold.covers(deps):
            return hold_refusal(hold)
    return None


@functools.lru_cache(maxsize=64)
def hold_refusal(hold: Hold) -> Refuse:
    """The refusal ``hold`` answers (``owner_active``, its detail, Retry-After and extras).

    One shared value per hold (a ``Refuse`` is frozen): a flood refused by the same hold gets
    the same value each time, which the proxy recognizes and answers from one rendering.
    """
    extra: dict[str, object] = {"hold": hold.kind.value}
    if hold.until is not None:
        extra["until"] = hold.until
    return Refuse.of(
        Reason.OWNER_ACTIVE, hold.detail, retry_after_s=retry_after_s(hold), extra=extra
    )
