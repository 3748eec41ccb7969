"""The Kubernetes API client: the only module that imports kubernetes_asyncio (style.md 5.4).

kubernetes_asyncio is the optional ``kubernetes`` extra; it is imported when a client is
made, so the daemon runs without it unless publishing is configured. Every failure of the
library (an ``ApiException``, a connection error, a bad kubeconfig) leaves this module as a
:class:`~vacancyd.k8s.api.K8sApiError` raised from it.

Auth: with no kubeconfig given, in-cluster credentials (the Pod's service
account) when ``KUBERNETES_SERVICE_HOST`` is set, else ``$KUBECONFIG`` or ``~/.kube/config``.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from vacancyd.k8s.api import K8sApiError

#: Where a Pod's ServiceAccount token and cluster CA are mounted.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def available() -> str | None:
    """None when kubernetes_asyncio can be imported, else what to install."""
    try:
        import kubernetes_asyncio  # noqa: F401
    except ImportError:
        return (
            "Kubernetes publishing needs the kubernetes extra: pip install 'vacancyd[kubernetes]'"
        )
    return None


def _api_message(exc: Any) -> str:
    """The API server's Status.message from an ApiException, else its reason."""
    body = getattr(exc, "body", None)
    if body:
        try:
            doc = json.loads(body)
        except (TypeError, ValueError):
            return str(body)[:500]
        if isinstance(doc, dict) and doc.get("message"):
            return str(doc["message"])
    return str(getattr(exc, "reason", "") or exc)


class KubeClient:
    """:class:`~vacancyd.k8s.api.KubeApi` over kubernetes_asyncio."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes_asyncio import client

        # The generated API classes take **kwargs; type them as Any rather than guess.
        self._client: Any = api_client
        self._core: Any = client.CoreV1Api(api_client)
        self._discovery: Any = client.DiscoveryV1Api(api_client)

    @classmethod
    async def connect(
        cls,
        kubeconfig: Path | None = None,
        context: str | None = None,
        *,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    ) -> KubeClient:
        """Load credentials (see module docstring). Raises K8sApiError when none work.

        ``service_account_dir`` holds the Pod's ``token`` and ``ca.crt`` (in-cluster auth).
        """
        missing = available()
        if missing is not None:
            raise K8sApiError("load credentials", None, missing)
        from kubernetes_asyncio import client
        from kubernetes_asyncio.config.config_exception import ConfigException

        config: Any = importlib.import_module("kubernetes_asyncio.config")

        try:
            if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                configuration = client.Configuration()
                config.load_incluster_config(
                    client_configuration=configuration,
                    token_filename=str(service_account_dir / "token"),
                    cert_filename=str(service_account_dir / "ca.crt"),
                )
                api_client = client.ApiClient(configuration=configuration)
            else:
                path = kubeconfig or os.environ.get("KUBECONFIG") or None
                api_client = await config.new_client_from_config(
                    config_file=str(path) if path else None,
                    context=context,
                    persist_config=False,
                )
        except (ConfigException, OSError, ValueError, TypeError) as exc:
            where = f" from {kubeconfig}" if kubeconfig else ""
            raise K8sApiError(f"load credentials{where}", None, str(exc)) from exc
        return cls(api_client)

    async def _run(self, operation: str, call: Any) -> Any:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return await call
        except ApiException as exc:
            raise K8sApiError(operation, exc.status, _api_message(exc)) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise K8sApiError(operation, None, f"{type(exc).__name__}: {exc}") from exc

    async def get_node_conditions(self, node: str) -> Sequence[Mapping[str, Any]]:
        obj = await self._run(f"get node {node}", self._core.read_node(node))
        doc = self._client.sanitize_for_serialization(obj)
        conds = (doc.get("status") or {}).get("conditions") or []
        return [c for c in conds if isinstance(c, dict)]

    async def read_node_status(self, node: str) -> tuple[str, Sequence[Mapping[str, Any]]]:
        obj = await self._run(f"get node {node}", self._core.read_node(node))
        doc = self._client.sanitize_for_serialization(obj)
        conds = (doc.get("status") or {}).get("conditions") or []
        version = str((doc.get("metadata") or {}).get("resourceVersion") or "")
        return version, [c for c in conds if isinstance(c, dict)]

    async def patch_node_status(self, node: str, patch: Mapping[str, Any]) -> None:
        await self._run(
            f"patch node {node} status",
            self._core.patch_node_status(
                node,
                dict(patch),
                _content_type="application/strategic-merge-patch+json",
            ),
        )

    async def apply_endpoint_slice(self, body: Mapping[str, Any], field_manager: str) -> None:
        meta = body["metadata"]
        await self._run(
            f"apply endpointslice {meta['namespace']}/{meta['name']}",
            self._discovery.patch_namespaced_endpoint_slice(
                meta["name"],
                meta["namespace"],
                dict(body),
                field_manager=field_manager,
                force=True,
                _content_type="application/apply-patch+yaml",
            ),
        )

    async def list_endpoint_slices(self, namespace: str, label_selector: str) -> list[str]:
        result = await self._run(
            f"list endpointslices in {namespace}",
            self._discovery.list_namespaced_endpoint_slice(
                namespace, label_selector=label_selector
            ),
        )
        return sorted(item.metadata.name for item in result.items)

    async def get_endpoint_slices(
        self, namespace: str, label_selector: str
    ) -> dict[str, Mapping[str, Any]]:
        result = await self._run(
            f"list endpointslices in {namespace}",
            self._discovery.list_namespaced_endpoint_slice(
                namespace, label_selector=label_selector
            ),
        )
        out: dict[str, Mapping[str, Any]] = {}
        for item in result.items:
            doc = self._client.sanitize_for_serialization(item)
            out[str(doc["metadata"]["name"])] = doc
        return out

    async def delete_endpoint_slice(self, namespace: str, name: str) -> None:
        try:
            await self._run(
                f"delete endpointslice {namespace}/{name}",
                self._discovery.delete_namespaced_endpoint_slice(name, namespace),
            )
        except K8sApiError as exc:
            if exc.status != 404:
                raise

    async def close(self) -> None:
        await self._client.close()
