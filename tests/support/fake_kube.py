"""An in-memory :class:`~vacancyd.k8s.api.KubeApi` for fast publisher tests.

It behaves like the API server where the publisher depends on it: a strategic-merge patch of
``status.conditions`` merges by ``type`` (kubelet's conditions stay), server-side apply
replaces the fields the applier sends, a Node that does not exist is a 404, and an endpoint
address that is loopback or link-local is a 422. Failures can be injected per operation
(``fail["patch_node_status"] = K8sApiError(...)``) and every call can be slowed (``delay_s``).
The real server is exercised by tests marked ``kube``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vacancyd.core.conditions import address_problem
from vacancyd.k8s.api import K8sApiError


@dataclass
class FakeKube:
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    slices: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    fail: dict[str, K8sApiError] = field(default_factory=dict)
    delay_s: float = 0.0
    calls: list[str] = field(default_factory=list)
    patches: list[dict[str, Any]] = field(default_factory=list)
    closed: int = 0

    def add_node(self, name: str, *, kubelet_ready: bool = True) -> None:
        conditions = []
        if kubelet_ready:
            conditions.append(
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            )
        self.nodes[name] = {"metadata": {"name": name}, "status": {"conditions": conditions}}

    def conditions(self, node: str) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for c in self.nodes[node]["status"]["conditions"]}

    async def _enter(self, op: str) -> None:
        self.calls.append(op)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if op in self.fail:
            raise self.fail[op]

    async def get_node_conditions(self, node: str) -> Sequence[Mapping[str, Any]]:
        await self._enter("get_node_conditions")
        if node not in self.nodes:
            raise K8sApiError(f"get node {node}", 404, f'nodes "{node}" not found')
        return copy.deepcopy(self.nodes[node]["status"]["conditions"])

    async def read_node_status(self, node: str) -> tuple[str, Sequence[Mapping[str, Any]]]:
        conditions = await self.get_node_conditions(node)
        return str(len(self.patches)), conditions

    async def patch_node_status(self, node: str, patch: Mapping[str, Any]) -> None:
        await self._enter("patch_node_status")
        if node not in self.nodes:
            raise K8sApiError(f"patch node {node} status", 404, f'nodes "{node}" not found')
        self.patches.append(copy.deepcopy(dict(patch)))
        current = self.nodes[node]["status"]["conditions"]
        by_type = {c["type"]: i for i, c in enumerate(current)}
        for cond in patch["status"]["conditions"]:
            if cond.get("$patch") == "delete":  # strategic merge: remove by the merge key
                current[:] = [c for c in current if c["type"] != cond["type"]]
                by_type = {c["type"]: i for i, c in enumerate(current)}
                continue
            if cond["type"] in by_type:
                merged = {**current[by_type[cond["type"]]], **cond}
                current[by_type[cond["type"]]] = merged
            else:
                current.append(copy.deepcopy(cond))

    async def apply_endpoint_slice(self, body: Mapping[str, Any], field_manager: str) -> None:
        await self._enter("apply_endpoint_slice")
        meta = body["metadata"]
        for ep in body["endpoints"]:
            for address in ep["addresses"]:
                problem = address_problem(address)
                if problem is not None:
                    raise K8sApiError(
                        f"apply endpointslice {meta['namespace']}/{meta['name']}",
                        422,
                        f"EndpointSlice.discovery.k8s.io {meta['name']!r} is invalid: "
                        f"endpoints[0].addresses[0]: Invalid value: {address!r}: {problem}",
                    )
        self.slices[(meta["namespace"], meta["name"])] = copy.deepcopy(dict(body))

    async def list_endpoint_slices(self, namespace: str, label_selector: str) -> list[str]:
        await self._enter("list_endpoint_slices")
        wanted = dict(part.split("=", 1) for part in label_selector.split(","))
        return sorted(
            name
            for (ns, name), body in self.slices.items()
            if ns == namespace
            and all(body["metadata"]["labels"].get(k) == v for k, v in wanted.items())
        )

    async def get_endpoint_slices(
        self, namespace: str, label_selector: str
    ) -> dict[str, Mapping[str, Any]]:
        await self._enter("get_endpoint_slices")
        wanted = dict(part.split("=", 1) for part in label_selector.split(","))
        # Like the API server's list: items without apiVersion and kind.
        return {
            name: {k: copy.deepcopy(v) for k, v in body.items() if k not in ("apiVersion", "kind")}
            for (ns, name), body in self.slices.items()
            if ns == namespace
            and all(body["metadata"]["labels"].get(k) == v for k, v in wanted.items())
        }

    async def delete_endpoint_slice(self, namespace: str, name: str) -> None:
        await self._enter("delete_endpoint_slice")
        self.slices.pop((namespace, name), None)

    async def close(self) -> None:
        self.closed += 1

    def slice(self, namespace: str, name: str) -> dict[str, Any]:
        return self.slices[(namespace, name)]

    async def connect(self) -> FakeKube:
        await self._enter("connect")
        return self
