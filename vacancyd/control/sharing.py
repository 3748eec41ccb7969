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

from vacancyd.adapters.base import Controller, UpstreamError
from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import Refuse
from vacancyd.core.sharing import UnloadTimeout, after_unload
from vacancyd.web.catalogue import histogram

log = logging.getLogger(__name__)

#: How often an unload is re-checked in the other servers' residency lists (seconds).
CONFIRM_INTERVAL_S = 0.25
#: Bound on asking a server to free its memory after an exclusive job (seconds).
FREE_DEADLINE_S = 10.0


@dataclass(frozen=True, slots=True)
class ExclusiveSettings:
    """One exclusive upstream's unload keys: ``unload_timeout_s`` (seconds) and the
    ``on_unload_timeout`` choice."""

    unload_timeout_s: float
    on_unload_timeout: UnloadTimeout


class CardSharing:
    """Unload-before-forward and free-after for upstreams with ``exclusive_of``.

    ``controllers``: upstream name -> its server controller (only servers with one can
    unload or free). ``warm_models``: upstream name -> ``warm_model``. ``clock``: monotonic
    seconds. ``registry``: where ``vacancyd_exclusive_unload_seconds`` is registered.
    """

    def __init__(
        self,
        policies: Mapping[str, UpstreamPolicy],
        settings: Mapping[str, ExclusiveSettings],
        controllers: Mapping[str, Controller],
        *,
        warm_models: Mapping[str, str],
        clock: Callable[[], float],
        registry: CollectorRegistry,
    ) -> None:
        self.policies = policies
        self.settings = settings
        self.controllers = controllers
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
        names = sorted(n for n in policy.exclusive_of if n in self.controllers)
        problems: list[str] = []
        asked: list[str] = []
        for name in names:
            try:
                async with asyncio.timeout(max(0.0, deadline - self.clock())):
                    _, detail = await self.controllers[name].unload(frozenset())
                asked.append(f"{name}: {detail}")
            except (UpstreamError, TimeoutError) as exc:
                problems.append(f"{name}: unload failed: {str(exc) or 'timed out'}")
        left = await self._confirm(names, deadline, problems)
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
        self, names: list[str], deadline: float, problems: list[str]
    ) -> dict[str, list[str]]:
        """Poll residency until every server is empty or ``deadline``; returns what is left."""
        left: dict[str, list[str]] = {}
        while True:
            left = {}
            for name in names:
                try:
                    models = await self.controllers[name].resident()
                except UpstreamError as exc:
                    problems.append(f"{name}: residency unreadable: {exc}")
                    names = [n for n in names if n != name]
                    continue
                if models:
                    left[name] = models
            if not left or self.clock() >= deadline:
                return left
            await asyncio.sleep(min(CONFIRM_INTERVAL_S, max(0.0, deadline - self.clock())))

    async def after_job(self, upstream: str, admitted: frozenset[str]) -> None:
        """Ask ``upstream``'s own server to free its memory; ``admitted``: the job keys this
        lender admitted there (a queue holding anyone else's work is not freed)."""
        controller = self.controllers.get(upstream)
        if controller is None:
            return
        try:
            async with asyncio.timeout(FREE_DEADLINE_S):
                outcome, detail = await controller.unload(admitted)
        except (UpstreamError, TimeoutError) as exc:
            log.warning("%s: freeing the card after the exclusive job failed: %s", upstream, exc)
            return
        log.info("%s: after the exclusive job: %s (%s)", upstream, detail, outcome)

    async def warm(self, upstream: str) -> None:
        """Load each excluded upstream's ``warm_model`` again (after an exclusive job)."""
        for name in sorted(self.policies[upstream].exclusive_of):
            model = self.warm_models.get(name)
            controller = self.controllers.get(name)
            if model is None or controller is None:
                continue
            try:
                async with asyncio.timeout(FREE_DEADLINE_S):
                    detail = await controller.warm(model)
            except (UpstreamError, TimeoutError) as exc:
                log.warning("warm reload of %r on %s failed: %s", model, name, exc)
                continue
            log.info("warm reload of %r on %s after the exclusive job: %s", model, name, detail)
