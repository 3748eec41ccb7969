"""The EndpointSlices vacancyd publishes for a lender, as pure values.

One per lender, upstream and Service. The gated Service's endpoint is ``ready`` while the
upstream is lendable; the ``-direct`` Service's endpoint is ready while the lender is alive
and its listener bound, so a borrower that goes through it gets a 503 with a reason instead
of a refused connection. ``serving`` is "the lender answers". Also here: the labels that
find them again, the uninstall marker that silences every publisher during a cleanup, and
the comparison that tells whether the server's copy needs a write. Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vacancyd.core.kubetime import parse_rfc3339
from vacancyd.core.lender import LenderState, UpstreamState

#: ``endpointslice.kubernetes.io/managed-by`` value on every EndpointSlice we write (a label
#: value: no ``/``), named like the endpointslice controller's ``endpointslice-controller.k8s.io``.
MANAGED_BY = "companion.vacancyd.io"
#: Labels that name what an EndpointSlice belongs to, so a resync finds and repairs it.
LENDER_LABEL = "vacancyd.io/lender"
UPSTREAM_LABEL = "vacancyd.io/upstream"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"

#: Annotations on a gated endpoint's EndpointSlice: what fits on the lender now.
LARGEST_MODEL_ANNOTATION = "vacancyd.io/largest-model"
LARGEST_MODEL_MIB_ANNOTATION = "vacancyd.io/largest-model-mib"
HEADROOM_ANNOTATION = "vacancyd.io/headroom-mib"

#: The uninstall marker: an EndpointSlice with this label (no endpoints, no Service) that
#: ``vacancyd k8s cleanup`` writes before it removes anything. Every publisher that sees it
#: stops writing, so nothing it removes is written back.
UNINSTALL_LABEL = "vacancyd.io/uninstall"
UNINSTALL_MARKER = "vacancyd-uninstall"
#: A marker older than this (seconds) is a leftover of a cleanup that did not finish, not
#: an uninstall in progress: it silences nobody (a reinstall publishes again).
UNINSTALL_MARKER_MAX_AGE_S = 600.0


def uninstall_marker(namespace: str) -> dict[str, Any]:
    """The uninstall marker EndpointSlice for ``namespace``. It carries our managed-by label
    (so a cleanup removes it with the rest) but no lender or Service label (so no publisher
    or kube-proxy mistakes it for a lender's endpoints)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": UNINSTALL_MARKER,
            "namespace": namespace,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY, UNINSTALL_LABEL: "true"},
        },
        "addressType": "IPv4",
        "endpoints": [],
    }


def uninstall_in_progress(markers: Mapping[str, Mapping[str, Any]], now_wall: float) -> bool:
    """True when one of ``markers`` (EndpointSlices labelled ``UNINSTALL_LABEL``, by name,
    as the server holds them) was created within ``UNINSTALL_MARKER_MAX_AGE_S`` of
    ``now_wall`` (epoch seconds). A marker without a creation time counts."""
    for body in markers.values():
        created = parse_rfc3339((body.get("metadata") or {}).get("creationTimestamp"))
        if created is None or now_wall - created <= UNINSTALL_MARKER_MAX_AGE_S:
            return True
    return False


_DNS_LABEL = re.compile(r"[^a-z0-9-]+")


def dns_name(*parts: str, limit: int = 63) -> str:
    """Join ``parts`` into a DNS-1123 label (lower case, ``-``, at most ``limit`` chars)."""
    raw = "-".join(_DNS_LABEL.sub("-", p.lower()).strip("-") for p in parts if p)
    raw = re.sub(r"-{2,}", "-", raw).strip("-") or "x"
    if len(raw) <= limit:
        return raw
    digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
    return raw[: limit - 9].rstrip("-") + "-" + digest


def address_problem(address: str) -> str | None:
    """Why the API server would reject ``address`` as an endpoint, or None.

    EndpointSlice validation refuses loopback, link-local and unspecified addresses (they
    would route to the node the client runs on, not to the lender).
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{address!r} is not an IP address"
    if ip.is_loopback:
        return f"{address} is a loopback address"
    if ip.is_link_local:
        return f"{address} is a link-local address"
    if ip.is_unspecified:
        return f"{address} is the unspecified address"
    if ip.is_multicast:
        return f"{address} is a multicast address"
    return None


@dataclass(frozen=True, slots=True)
class SliceTarget:
    """Which Service an upstream's endpoint joins, and how.

    ``direct``: the endpoint is ready while the lender is alive and listening (the
    ``-direct`` Service), instead of while the upstream is lendable.
    """

    service: str
    port_name: str = "http"
    direct: bool = False


def endpoint_flags(lender: LenderState, upstream: str, *, direct: bool) -> tuple[bool, bool]:
    """(would be ready, answers) for ``upstream``'s endpoint, ignoring termination.

    ``answers`` is "the lender answers and this listener is bound"; the first value is that
    plus, for the gated Service, "lendable now". :func:`endpoint_conditions` turns them into
    the published conditions.
    """
    up = lender.upstreams.get(upstream)
    answers = lender.alive and up is not None and up.bound
    ready = answers and (direct or (up is not None and up.lendable))
    return ready, answers


@dataclass(frozen=True, slots=True)
class EndpointConditions:
    """An endpoint's ``conditions`` as discovery.k8s.io/v1 defines them.

    ``serving`` equals ``ready`` except while ``terminating``: then ``ready`` is False and
    ``serving`` still says whether the endpoint would take traffic (kube-proxy falls back to
    serving, terminating endpoints only when a Service has no ready one).
    """

    ready: bool
    serving: bool
    terminating: bool

    def as_dict(self) -> dict[str, bool]:
        return {"ready": self.ready, "serving": self.serving, "terminating": self.terminating}


def endpoint_conditions(lender: LenderState, upstream: str, *, direct: bool) -> EndpointConditions:
    """The published conditions of ``upstream``'s endpoint in a gated or ``-direct`` Service.

    Every field is always set (an absent ``ready`` would count as ready).
    """
    would, _answers = endpoint_flags(lender, upstream, direct=direct)
    if lender.terminating:
        return EndpointConditions(ready=False, serving=would, terminating=True)
    return EndpointConditions(ready=would, serving=would, terminating=False)


def endpoint_slice(
    *,
    lender: str,
    upstream: str,
    namespace: str,
    target: SliceTarget,
    address: str,
    port: int,
    ready: bool,
    serving: bool,
    node_name: str | None = None,
    terminating: bool = False,
    headroom: UpstreamState | None = None,
) -> dict[str, Any]:
    """The EndpointSlice for one lender's upstream in one Service.

    Its name is unique per (Service, lender, upstream), so many lenders can join one
    Service. Applied with server-side apply, every field here is ours; anything an outside
    edit changed is put back on the next write. ``headroom``, when given, adds the
    ``vacancyd.io/largest-model``, ``vacancyd.io/largest-model-mib`` and
    ``vacancyd.io/headroom-mib`` annotations (absent values are left out, so server-side
    apply removes them).
    """
    family = "IPv6" if ":" in address else "IPv4"
    endpoint: dict[str, Any] = {
        "addresses": [address],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
    }
    if node_name:
        endpoint["nodeName"] = node_name
    annotations: dict[str, str] = {}
    if headroom is not None:
        if headroom.largest_model is not None:
            annotations[LARGEST_MODEL_ANNOTATION] = headroom.largest_model
            annotations[LARGEST_MODEL_MIB_ANNOTATION] = str(headroom.largest_model_mib)
        if headroom.headroom_mib is not None:
            annotations[HEADROOM_ANNOTATION] = str(headroom.headroom_mib)
    metadata: dict[str, Any] = {
        "name": dns_name(target.service, lender, upstream),
        "namespace": namespace,
    }
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            **metadata,
            "labels": {
                SERVICE_NAME_LABEL: target.service,
                MANAGED_BY_LABEL: MANAGED_BY,
                LENDER_LABEL: dns_name(lender),
                UPSTREAM_LABEL: dns_name(upstream),
            },
        },
        "addressType": family,
        "endpoints": [endpoint],
        "ports": [{"name": target.port_name, "port": port, "protocol": "TCP"}],
    }


def slice_matches(desired: Any, current: Any) -> bool:
    """True when ``current`` (an object as the server holds it) already carries every field
    of ``desired`` with the same value; fields the server added (defaults, managedFields,
    resourceVersion) do not matter. Lists must match element by element."""
    if isinstance(desired, Mapping):
        if not isinstance(current, Mapping):
            return False
        return all(k in current and slice_matches(v, current[k]) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(current, list) or len(current) != len(desired):
            return False
        return all(slice_matches(d, c) for d, c in zip(desired, current, strict=True))
    return bool(desired == current)


OUR_ANNOTATIONS = (LARGEST_MODEL_ANNOTATION, LARGEST_MODEL_MIB_ANNOTATION, HEADROOM_ANNOTATION)


def slice_up_to_date(desired: Mapping[str, Any], current: Mapping[str, Any] | None) -> bool:
    """True when the server's copy ``current`` needs no write to become ``desired``: every
    field we set matches, and none of our annotations lingers that ``desired`` dropped."""
    if current is None:
        return False
    # Items of a list carry no apiVersion/kind: compare everything else.
    fields = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    if not slice_matches(fields, current):
        return False
    want = desired.get("metadata", {}).get("annotations") or {}
    have = (current.get("metadata") or {}).get("annotations") or {}
    return all(want.get(k) == have.get(k) for k in OUR_ANNOTATIONS)
