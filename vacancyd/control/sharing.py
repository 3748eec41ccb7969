"""The effects of exclusivity: unload the other servers before an exclusive job, free after.

The rules are pure (:mod:`vacancyd.core.sharing`); this module calls the servers:

* before an exclusive job (a ComfyUI prompt) is forwarded, every upstream it is exclusive of
  (Ollama) is asked to unload its models, and their residency lists are polled until they are
  empty or ``unload_timeout_s`` passes. ``on_unload_timeout`` decides what a timeout means:
  forward anyway (the default) or refuse the job ``resource_busy``;
* after the exclusive job ends, its own server is asked to free its memory (ComfyUI
  ``/free``) before the reservation is released, so the next LLM job finds the card empty;
* then, when no other exclusive job holds or waits for the card, each excluded upstream with
  ``warm_model`` loads that model again.

Upstream failures are logged and never raised into a request: an unreachable Ollama cannot
block an image job (that is what the timeout choice is for), and a failed ``/free`` still
releases the reservation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from vacancyd.control.upstreamcalls import Status, UpstreamCalls
from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import Refuse
from vacancyd.core.sharing import UnloadTimeout, after_unload
from vacancyd.web.catalogue import histogram

log = logging.getLogger(__name__)

#: How often an unload is re-checked in the other servers' residency lists (seconds).
CONFIRM_INTERVAL_S = 0.25


@dataclass(frozen=True, slots=True)
class ExclusiveSettings:
    """One exclusive upstream's unload keys: ``unload_timeout_s`` (seconds) and the
    ``on_unload_timeout`` choice."""

    unload_timeout_s: float
    on_unload_timeout: UnloadTimeout


class CardSharing:
    """Unload-before-forward and free-after for upstreams with ``exclusive_of``.

    ``calls``: every call to the servers (only servers with a controller can unload or
    free; :mod:`vacancyd.control.upstreamcalls` bounds, counts and logs each).
    ``warm_models``: upstream name -> ``warm_model``. ``clock``: monotonic seconds.
    ``registry``: where ``vacancyd_exclusive_unload_seconds`` is registered.
    """

    def __init__(
        self,
        policies: Mapping[str, UpstreamPolicy],
        settings: Mapping[str, ExclusiveSettings],
        calls: UpstreamCalls,
        *,
        warm_models: Mapping[str, str],
        clock: Callable[[], float],
        registry: CollectorRegistry,
    ) -> None:
        self.policies = policies
        self.settings = settings
        self.calls = calls
        self.warm_models = warm_models
        self.clock = clock
        self.m_unload = histogram(
            "vacancyd_exclusive_unload_seconds",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )

    def is_exclusive(self, upstream: str) -> bool:
        policy = self.policies.get(upstream)
        return policy is not None and bool(policy.exclusive_of)

    async def before_forward(self, upstream: str) -> Refuse | None:
        """Unload every upstream ``upstream`` is exclusive of; None to forward, or the
        refusal ``on_unload_timeout = "refuse"`` gives when the unload is not confirmed."""
        policy = self.policies[upstream]
        settings = self.settings[upstream]
        started = self.clock()
        deadline = started + settings.unload_timeout_s
        names = sorted(n for n in policy.exclusive_of if self.calls.supports(n))
        problems: list[str] = []
        asked: list[str] = []
        why = f"exclusive job of {upstream}"
        for name in names:
            cleared = await self.calls.clear(name, deadline - self.clock(), why=why)
            if cleared.done or cleared.status is Status.SKIPPED:
                asked.append(f"{name}: {cleared.detail}")
            else:
                problems.append(f"{name}: unload failed: {cleared.detail or cleared.status}")
        left = await self._confirm(upstream, names, deadline, problems)
        elapsed = self.clock() - started
        confirmed = not left and not problems
        self.m_unload.labels(upstream, "confirmed" if confirmed else "timed_out").observe(elapsed)
        detail = "; ".join(problems + [f"{n} still holds {', '.join(m)}" for n, m in left.items()])
        if confirmed:
            log.info(
                "%s: the card is exclusive; unloaded in %.2f s (%s)",
                upstream,
                elapsed,
                "; ".join(asked) or "no server to unload",
            )
            return None
        refusal = after_unload(False, settings.on_unload_timeout, detail)
        log.warning(
            "%s: unload before the exclusive job not confirmed after %.2f s (%s); %s",
            upstream,
            elapsed,
            detail,
            "refusing the job" if refusal is not None else "forwarding it anyway",
        )
        return refusal

    async def _confirm(
        self, upstream: str, names: list[str], deadline: float, problems: list[str]
    ) -> dict[str, list[str]]:
        """Poll residency until every server is empty or ``deadline``; returns what is left."""
        left: dict[str, list[str]] = {}
        while True:
            left = {}
            for name in names:
                read = await self.calls.resident(name, why=f"exclusive job of {upstream}")
                if not read.done:
                    problems.append(f"{name}: residency unreadable: {read.detail}")
                    names = [n for n in names if n != name]
                    continue
                if read.value:
                    left[name] = read.value
            if not left or self.clock() >= deadline:
                return left
            await asyncio.sleep(min(CONFIRM_INTERVAL_S, max(0.0, deadline - self.clock())))

    async def after_job(self, upstream: str, admitted: frozenset[str]) -> None:
        """Ask ``upstream``'s own server to free its memory; ``admitted``: the job keys this
        lender admitted there (a queue holding anyone else's work is not freed)."""
        if self.calls.supports(upstream):
            await self.calls.free(upstream, admitted, why=f"after the exclusive job on {upstream}")

    async def warm(self, upstream: str) -> None:
        """Load each excluded upstream's ``warm_model`` again (after an exclusive job)."""
        for name in sorted(self.policies[upstream].exclusive_of):
            model = self.warm_models.get(name)
            if model is not None and self.calls.supports(name):
                await self.calls.warm(name, model, why="warm reload after the exclusive job")
