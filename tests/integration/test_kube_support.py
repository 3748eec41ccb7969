"""The kube test harness itself: a real kube-apiserver + etcd, kubectl and kubernetes_asyncio.

The ``kube`` tests need the binaries from ``tools/build-kube-tools.sh``; they skip
without them (fail with ``VACANCYD_REQUIRE_TOOLS=1``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.rest import ApiException

from tests.support.kube import (
    ApiServer,
    kube_tool,
    require_kube_tools,
    running_apiserver,
    write_kubeconform_schemas,
)

CONDITION_TYPE = "VacancydGPULendable"


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """One API server for the whole module (startup takes seconds)."""
    require_kube_tools()
    with running_apiserver(tmp_path_factory.mktemp("apiserver")) as api:
        yield api


async def _api_client(kubeconfig: Path) -> client.ApiClient:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return client.ApiClient(configuration)


@pytest.fixture
async def admin_client(apiserver: ApiServer) -> AsyncIterator[client.ApiClient]:
    """A kubernetes_asyncio client logged in as the admin user."""
    async with await _api_client(apiserver.kubeconfig) as api:
        yield api


def _node_manifest(name: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"vacancyd.test/owner": "kube-support"}},
        }
    )


@pytest.mark.kube
def test_kubectl_patches_node_status_condition(apiserver: ApiServer) -> None:
    apiserver.kubectl("create", "-f", "-", input=_node_manifest("gpu-node-a"))
    patch = {
        "status": {
            "conditions": [
                {
                    "type": CONDITION_TYPE,
                    "status": "True",
                    "reason": "OwnerIdle",
                    "message": "GPU idle, lent out by vacancyd",
                    "lastHeartbeatTime": "2025-01-01T00:00:00Z",
                    "lastTransitionTime": "2025-01-01T00:00:00Z",
                }
            ]
        }
    }
    apiserver.kubectl(
        "patch", "node", "gpu-node-a",
        "--subresource=status", "--type=strategic", "-p", json.dumps(patch),
    )  # fmt: skip

    described = apiserver.kubectl("describe", "node", "gpu-node-a").stdout
    assert CONDITION_TYPE in described
    assert "OwnerIdle" in described
    assert "GPU idle, lent out by vacancyd" in described

    status = apiserver.kubectl(
        "get", "node", "gpu-node-a",
        "-o", f"jsonpath={{.status.conditions[?(@.type==\"{CONDITION_TYPE}\")].status}}",
    ).stdout  # fmt: skip
    assert status == "True"


@pytest.mark.kube
async def test_kubernetes_asyncio_lists_nodes(
    apiserver: ApiServer, admin_client: client.ApiClient
) -> None:
    core = client.CoreV1Api(admin_client)
    await core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="gpu-node-b")))
    nodes = await core.list_node()
    names = {node.metadata.name for node in nodes.items}
    assert "gpu-node-b" in names


@pytest.mark.kube
async def test_limited_token_cannot_list_nodes(apiserver: ApiServer) -> None:
    async with await _api_client(apiserver.limited_kubeconfig) as api:
        with pytest.raises(ApiException) as excinfo:
            await client.CoreV1Api(api).list_node()
    assert excinfo.value.status == 403

    can_i = apiserver.kubectl("auth", "can-i", "list", "nodes", limited=True, check=False)
    assert can_i.stdout.strip() == "no"
    assert apiserver.kubectl("auth", "can-i", "list", "nodes").stdout.strip() == "yes"


@pytest.mark.kube
def test_kubeconform_validates_offline(apiserver: ApiServer, tmp_path: Path) -> None:
    """kubeconform needs no network with schemas generated from the server's OpenAPI."""
    tools = require_kube_tools("kubeconform")
    location = write_kubeconform_schemas(apiserver, tmp_path)
    good: dict[str, Any] = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "vacancyd-1", "namespace": "default", "creationTimestamp": None},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": True}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }
    node_with_quantities: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "n"},
        "status": {"capacity": {"nvidia.com/gpu": 1, "memory": "64Gi"}},
    }

    def summary(obj: dict[str, Any], *extra: str) -> dict[str, int]:
        proc = subprocess.run(
            [
                str(tools["kubeconform"]), "-schema-location", location,
                "-output", "json", "-summary", *extra, "-",
            ],
            input=json.dumps(obj), capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        result: dict[str, int] = json.loads(proc.stdout)["summary"]
        return result

    valid = {"valid": 1, "invalid": 0, "errors": 0, "skipped": 0}
    invalid = {"valid": 0, "invalid": 1, "errors": 0, "skipped": 0}
    assert summary(good) == valid
    assert summary(good, "-strict") == valid
    assert summary(node_with_quantities, "-strict") == valid
    assert summary({**good, "ports": [{"name": "http", "port": "eighty"}]}) == invalid
    typo = {**good, "adressType": "IPv4"}
    assert summary(typo) == valid
    assert summary(typo, "-strict") == invalid


def test_require_kube_tools_skips_or_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing binaries skip a test, or fail it when CI demands the tools."""
    monkeypatch.setenv("VACANCYD_TOOLS_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert kube_tool("kube-apiserver") is None

    monkeypatch.delenv("VACANCYD_REQUIRE_TOOLS", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"tools/build-kube-tools\.sh"):
        require_kube_tools("kube-apiserver")

    monkeypatch.setenv("VACANCYD_REQUIRE_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception, match="kube-apiserver"):
        require_kube_tools("kube-apiserver")

    fake = tmp_path / "kube" / "bin" / "kube-apiserver"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert require_kube_tools("kube-apiserver") == {"kube-apiserver": fake}
