"""The few Kubernetes API calls the publisher makes, as a Protocol, and their one error type.

``vacancyd.k8s.client`` implements it with kubernetes_asyncio; tests may implement it in
memory. Every method raises :class:`K8sApiError` and nothing else on failure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class K8sApiError(Exception):
    """A Kubernetes API call failed.

    ``status`` is the HTTP status (403 forbidden, 404 not found, 409 conflict, 422 invalid),
    or None when no answer came (connection refused, timeout). ``message`` is the API
    server's own explanation when it gave one.
    """

    def __init__(self, operation: str, status: int | None, message: str) -> None:
        self.operation = operation
        self.status = status
        self.message = message
        code = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{operation}: {code}: {message}")

    @property
    def hint(self) -> str:
        """What an operator should do about it, in one sentence."""
        if self.status is None:
            return "the API server is unreachable or slow; retrying"
        if self.status in (401, 403):
            return (
                "the credentials lack a permission: vacancyd needs get on nodes, patch on "
                "nodes/status and get/list/create/patch/delete on endpointslices in its "
                "namespace (see charts/vacancyd/templates/rbac.yaml)"
            )
        if self.status == 404:
            return "the object does not exist (is the Node name right?)"
        if self.status == 409:
            return "a conflicting write; retrying"
        if self.status == 422:
            if "address" in self.message:
                return (
                    "the API server rejected the object: an endpoint address cannot be "
                    "loopback or link-local; set the lender's address to an IP the cluster "
                    "routes to"
                )
            return "the API server rejected the object as invalid (see its message)"
        return "retrying"


class KubeApi(Protocol):
    """What the publisher needs from the API server."""

    async def get_node_conditions(self, node: str) -> Sequence[Mapping[str, Any]]:
        """The Node's ``status.conditions`` (raises K8sApiError 404 if it does not exist)."""

    async def read_node_status(self, node: str) -> tuple[str, Sequence[Mapping[str, Any]]]:
        """(the Node's ``metadata.resourceVersion``, its ``status.conditions``); a patch that
        carries that resourceVersion fails with 409 if the Node changed meanwhile."""

    async def patch_node_status(self, node: str, patch: Mapping[str, Any]) -> None:
        """Strategic-merge-patch ``nodes/NODE/status`` with ``patch``."""

    async def apply_endpoint_slice(self, body: Mapping[str, Any], field_manager: str) -> None:
        """Server-side apply ``body`` (force: our fields are ours)."""

    async def list_endpoint_slices(self, namespace: str, label_selector: str) -> list[str]:
        """Names of the EndpointSlices in ``namespace`` matching ``label_selector``."""

    async def get_endpoint_slices(
        self, namespace: str, label_selector: str
    ) -> dict[str, Mapping[str, Any]]:
        """The EndpointSlices in ``namespace`` matching ``label_selector``, by name, each as
        the API server holds it (a JSON-shaped dict)."""

    async def delete_endpoint_slice(self, namespace: str, name: str) -> None:
        """Delete one EndpointSlice (a 404 is not an error)."""

    async def close(self) -> None:
        """Release connections."""
