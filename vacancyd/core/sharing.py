"""Sharing a resource between borrowed jobs: concurrency slots and exclusivity.

Pure rules the ledger applies before it reserves a job; no clock, no I/O.

Slots (``max_concurrent``): a resource holds at most as many jobs as the smallest
``max_concurrent`` among the upstreams of the jobs on it, the newcomer's included. With the
default of 1 everywhere a resource holds one job at a time. Slots only bound how many jobs
run; memory is still charged per admission by the gate.

Exclusivity (``exclusive_of``): an upstream that lists others in ``exclusive_of`` (an image
server such as ComfyUI beside an LLM server such as Ollama on one GPU) takes the card from
them: its jobs never overlap theirs, their jobs may still run concurrently among themselves,
and while one of its requests waits for the card no new job of theirs is admitted (the
waiting job has priority, so a stream of LLM requests cannot starve it). Before its job is
forwarded the other servers are asked to unload their models, and after it ends its own
server frees its memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum

from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import Reason, Refuse


class CardState(StrEnum):
    """What a resource is doing, exported as ``vacancyd_exclusivity_state``.

    ``idle``: no borrowed job. ``shared``: jobs of upstreams that share the card (LLM work).
    ``exclusive``: a job of an upstream that takes the card exclusively (an image job).
    """

    IDLE = "idle"
    SHARED = "shared"
    EXCLUSIVE = "exclusive"


class UnloadTimeout(StrEnum):
    """``on_unload_timeout``: what an exclusive job does when the other servers' models are
    not confirmed gone within ``unload_timeout_s``.

    ``forward``: log it and forward the job anyway (the models may still be freed while it
    runs; the gate has charged the job against a fresh capacity sample either way).
    ``refuse``: release the job and refuse it ``resource_busy``.
    """

    FORWARD = "forward"
    REFUSE = "refuse"


def conflicts(a: UpstreamPolicy, b: str) -> bool:
    """True when jobs of upstream ``a`` and upstream ``b`` may never run at once."""
    return b in a.exclusive_of or b in a.excluded_by


def slot_refusal(
    policy: UpstreamPolicy,
    holders: Mapping[str, Sequence[str]],
    policies: Mapping[str, UpstreamPolicy],
    waiting: Mapping[str, int],
) -> Refuse | None:
    """Whether a new job of ``policy``'s upstream fits next to the jobs already admitted.

    ``holders`` maps a resource to the upstream names of its active jobs (one entry per
    job); ``policies`` maps upstream names to their policies; ``waiting`` maps upstream names
    to their number of waiting requests. Returns None when the job fits, else a
    ``resource_busy`` refusal naming the resource and why.
    """
    for pending in sorted(policy.excluded_by):
        if waiting.get(pending, 0) > 0:
            return Refuse.of(
                Reason.RESOURCE_BUSY,
                f"upstream {pending!r} is waiting to use {policy.resource!r} exclusively and "
                "goes first",
                resource=policy.resource,
            )
    for name in policy.resources:
        jobs = holders.get(name, ())
        if not jobs:
            continue
        for other in jobs:
            if conflicts(policy, other):
                return Refuse.of(
                    Reason.RESOURCE_BUSY,
                    f"{name!r} is in use by upstream {other!r}, which never shares it with "
                    f"{policy.name!r}",
                    resource=name,
                )
        limit = min(
            policy.max_concurrent,
            *(policies[o].max_concurrent if o in policies else 1 for o in jobs),
        )
        if len(jobs) >= limit:
            return Refuse.of(
                Reason.RESOURCE_BUSY,
                f"{name!r} is lent to {len(jobs)} borrowed job(s) "
                f"({_describe(jobs)}); at most {limit} may run on it at once",
                resource=name,
                extra={"slots": limit, "jobs": len(jobs)},
            )
    return None


def _describe(jobs: Iterable[str]) -> str:
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job] = counts.get(job, 0) + 1
    return ", ".join(f"upstream {u!r} × {n}" for u, n in sorted(counts.items()))


def card_state(
    resource: str, holders: Mapping[str, Sequence[str]], policies: Mapping[str, UpstreamPolicy]
) -> CardState:
    """The :class:`CardState` of ``resource`` given its active jobs' upstreams."""
    jobs = holders.get(resource, ())
    if not jobs:
        return CardState.IDLE
    if any(o in policies and policies[o].exclusive_of for o in jobs):
        return CardState.EXCLUSIVE
    return CardState.SHARED


def serve_order(policies: Mapping[str, UpstreamPolicy]) -> list[str]:
    """Upstream names in the order their wait queues are served after a release: upstreams
    that take a card exclusively first (they have priority), then the rest, each by name."""
    return sorted(policies, key=lambda n: (not policies[n].exclusive_of, n))


def excluded_by(policies: Mapping[str, UpstreamPolicy]) -> dict[str, frozenset[str]]:
    """For each upstream, the upstreams that list it in ``exclusive_of``."""
    out: dict[str, set[str]] = {name: set() for name in policies}
    for name, policy in policies.items():
        for other in policy.exclusive_of:
            out.setdefault(other, set()).add(name)
    return {name: frozenset(v) for name, v in out.items()}


def after_unload(confirmed: bool, on_timeout: UnloadTimeout, detail: str) -> Refuse | None:
    """Whether an exclusive job goes ahead after asking the other servers to unload.

    ``confirmed``: every model is gone from the other servers' residency lists. Returns None
    to forward, or the refusal for ``on_unload_timeout = "refuse"``.
    """
    if confirmed or on_timeout is UnloadTimeout.FORWARD:
        return None
    return Refuse.of(
        Reason.RESOURCE_BUSY,
        f"the servers sharing the card did not unload their models in time: {detail}",
    )
