"""One-shot upkeep of what vacancyd published: stale Node conditions, and an uninstall.

``vacancyd k8s mark-stale`` (:func:`mark_stale`) is the answer to "who resets a custom Node
condition whose writer died": Kubernetes' node lifecycle controller marks only kubelet's own
conditions Unknown, so a ``VacancyLendable: True`` left by a host-side lender that was
switched off at the wall would stay True forever. The check reads the named Nodes and marks
each of our conditions whose ``lastHeartbeatTime`` is older than the staleness limit
``Unknown`` with reason ``PublisherStale``. Its patch carries the Node's resourceVersion, so
a publisher that writes in between wins (the API server answers 409 and the check leaves the
Node alone). The chart runs it as a CronJob for host-side publishers.

``vacancyd k8s cleanup`` (:func:`cleanup`) removes what vacancyd wrote: the EndpointSlices
labelled ``endpointslice.kubernetes.io/managed-by: companion.vacancyd.io`` in a namespace,
and every ``Vacancy*`` condition on the named Nodes. Objects and conditions of anyone else
are never touched. Publishers still run while it does (the chart runs it as a pre-delete
hook, before the companion is deleted), so it first writes an uninstall marker that makes
every publisher stop writing (:func:`vacancyd.k8s.publisher.watch_uninstall`), waits for
them to see it, and removes the marker last.

Both report what they did as :class:`Outcome` and raise nothing but
:class:`~vacancyd.k8s.api.K8sApiError` for a failure that stops the whole pass (an API
server that does not answer); a failure on one Node is recorded and the pass goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vacancyd.core import endpoints, nodeconditions
from vacancyd.k8s.api import K8sApiError, KubeApi

log = logging.getLogger(__name__)

#: The field manager of the uninstall marker.
CLEANUP_MANAGER = "vacancyd-cleanup"


@dataclass
class Outcome:
    """What a pass did: ``changed`` nodes or slices (names), ``errors`` (one line each)."""

    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


async def mark_stale(
    api: KubeApi,
    nodes: Sequence[str],
    stale_after_s: float,
    *,
    wall: Callable[[], float] = time.time,
) -> Outcome:
    """Mark our conditions on ``nodes`` Unknown (``PublisherStale``) where their heartbeat
    is older than ``stale_after_s`` seconds. A Node that changed between the read and the
    patch (409) is left for the next pass; a missing Node (404) is an error of that Node."""
    out = Outcome()
    for node in nodes:
        try:
            version, current = await api.read_node_status(node)
            patch = nodeconditions.stale_patch(current, wall(), stale_after_s)
            if patch is None:
                out.unchanged.append(node)
                continue
            if version:
                patch["metadata"] = {"resourceVersion": version}
            await api.patch_node_status(node, patch)
        except K8sApiError as exc:
            if exc.status == 409:
                log.info("node %s changed while it was checked: its publisher is back", node)
                out.unchanged.append(node)
                continue
            if exc.status is None:
                raise
            out.errors.append(f"{exc} ({exc.hint})")
            continue
        kinds = [c["type"] for c in patch["status"]["conditions"]]
        log.warning(
            "node %s: %s had no heartbeat for over %.0f s: marked Unknown (%s)",
            node,
            ", ".join(kinds),
            stale_after_s,
            nodeconditions.PUBLISHER_STALE,
        )
        out.changed.append(node)
    return out


def _selector(lenders: Sequence[str]) -> list[str]:
    base = f"{endpoints.MANAGED_BY_LABEL}={endpoints.MANAGED_BY}"
    if not lenders:
        return [base]
    return [f"{base},{endpoints.LENDER_LABEL}={endpoints.dns_name(n)}" for n in lenders]


async def cleanup(
    api: KubeApi,
    namespace: str,
    nodes: Sequence[str],
    *,
    lenders: Sequence[str] = (),
    stand_down_s: float = 0.0,
) -> Outcome:
    """Delete vacancyd's EndpointSlices in ``namespace`` (only those of ``lenders`` when
    given) and remove every ``Vacancy*`` condition from ``nodes``. A Node that does not
    exist is skipped (nothing to clean); other per-object failures are recorded.

    ``stand_down_s`` > 0: first write the uninstall marker and wait that many seconds, so
    that every publisher still running (a companion, a host-side lender) sees it and stops
    writing (they look every ``UNINSTALL_POLL_S`` seconds); the marker is removed last.
    """
    out = Outcome()
    if stand_down_s > 0:
        await api.apply_endpoint_slice(endpoints.uninstall_marker(namespace), CLEANUP_MANAGER)
        log.info("uninstall marker written; waiting %.0f s for publishers to stop", stand_down_s)
        await asyncio.sleep(stand_down_s)
    names: set[str] = set()
    for selector in _selector(lenders):
        names.update(await api.list_endpoint_slices(namespace, selector))
    names.discard(endpoints.UNINSTALL_MARKER)
    for name in sorted(names):
        try:
            await api.delete_endpoint_slice(namespace, name)
        except K8sApiError as exc:
            out.errors.append(f"{exc} ({exc.hint})")
            continue
        log.info("deleted EndpointSlice %s/%s", namespace, name)
        out.changed.append(f"endpointslice/{name}")
    for node in nodes:
        try:
            current = await api.get_node_conditions(node)
            patch = nodeconditions.cleanup_patch(current)
            if patch is None:
                out.unchanged.append(f"node/{node}")
                continue
            await api.patch_node_status(node, patch)
        except K8sApiError as exc:
            if exc.status == 404:
                out.unchanged.append(f"node/{node}")
                continue
            out.errors.append(f"{exc} ({exc.hint})")
            continue
        removed = [c["type"] for c in patch["status"]["conditions"]]
        log.info("node %s: removed %s", node, ", ".join(removed))
        out.changed.append(f"node/{node}")
    if stand_down_s > 0:
        try:
            await api.delete_endpoint_slice(namespace, endpoints.UNINSTALL_MARKER)
        except K8sApiError as exc:
            out.errors.append(f"{exc} ({exc.hint})")
    return out


def summary(what: str, outcome: Outcome) -> dict[str, Any]:
    """``outcome`` as the JSON line the CLI prints."""
    return {
        "action": what,
        "changed": outcome.changed,
        "unchanged": outcome.unchanged,
        "errors": outcome.errors,
    }
