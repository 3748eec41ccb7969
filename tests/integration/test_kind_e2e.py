"""End to end in a kind cluster, for machines with Docker: the companion image built from the
repository's Dockerfile runs as the chart's Deployment, follows a real lender on the host,
and a real kube-proxy routes a Pod's requests through the gated Service only while the lender
is lendable.

This needs ``docker`` and ``kind`` on PATH and a running Docker daemon. Where they are
missing (the build machines these tests usually run on), every test here is skipped with
the reason, which pytest's ``-ra`` summary prints: a skip, never a pass. What it adds over
tests/integration/test_kube_routing.py, which applies kube-proxy's endpoint selection to
the published slices, is the real kube-proxy, real Pods, and the real image.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.config import daemon_toml, token, upstream
from tests.support.daemon import RunningDaemon, openai_like_app, running_daemon, serve_app
from tests.support.k8s_lender import BORROW, READ

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "vacancyd"
CLUSTER = "vacancyd-e2e"
IMAGE = "vacancyd:e2e"
NS = "vacancyd"


def _docker_ready() -> str | None:
    """None when docker and kind can run a cluster here, else why not."""
    for tool in ("docker", "kind", "kubectl", "helm"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH (this e2e needs Docker, kind, kubectl and helm)"
    proc = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return "the Docker daemon is not running (docker info failed)"
    return None


pytestmark = pytest.mark.skipif(
    _docker_ready() is not None, reason=f"kind e2e not run: {_docker_ready()}"
)


def run(*argv: str, input: str | None = None, timeout: float = 600) -> str:
    proc = subprocess.run(
        argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr}")
    return proc.stdout


def kubectl(*args: str, input: str | None = None) -> str:
    return run("kubectl", "--context", f"kind-{CLUSTER}", *args, input=input)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A one-node kind cluster with the image loaded; yields the host's address on the
    cluster's Docker network (where the lender listens)."""
    run("kind", "create", "cluster", "--name", CLUSTER, "--wait", "120s")
    try:
        run("docker", "build", "-t", IMAGE, str(ROOT), timeout=1800)
        run("kind", "load", "docker-image", IMAGE, "--name", CLUSTER)
        network = json.loads(run("docker", "network", "inspect", "kind"))
        gateway = next(
            c["Gateway"] for c in network[0]["IPAM"]["Config"] if ":" not in c["Gateway"]
        )
        yield str(gateway)
    finally:
        run("kind", "delete", "cluster", "--name", CLUSTER)


def lender_config(target: str, host: str) -> str:
    return daemon_toml(
        upstream("chat", target, listen=f"{host}:0"),
        server={"listen": f"{host}:0", "trust_loopback": None},
        tokens=(token("companion", READ, "read"), token("borrower", BORROW, "borrow")),
        collectors={"poll_s": None},
    )


def in_pod(url: str) -> str:
    """HTTP status of a POST from a throwaway Pod (a real kube-proxy routes it)."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    out = kubectl(
        "-n", NS, "run", f"probe-{time.monotonic_ns()}", "--rm", "-i", "--restart=Never",
        "--image=curlimages/curl:8.10.1", "--", "curl", "-s", "-o", "/dev/null",
        "-w", "%{http_code}", "--max-time", "5", "-H", f"Authorization: Bearer {BORROW}",
        "-H", "Content-Type: application/json", "-d", body, url,
    )  # fmt: skip
    return out.strip()[-3:]


def until(check: Any, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(1)


async def test_kube_proxy_routes_only_to_a_lendable_lender(cluster: str, tmp_path: Path) -> None:
    host = cluster
    app, seen = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_config(target, host)) as d:
        await _run_scenario(d, host, tmp_path, seen)


async def _run_scenario(d: RunningDaemon, host: str, tmp_path: Path, seen: list[Any]) -> None:
    api_port = d.daemon.bound["api"].rsplit(":", 1)[1]
    values = {
        "upstreams": [{"name": "chat", "port": 80}],
        "lenders": [{"name": "pc", "url": f"http://{host}:{api_port}", "address": host}],
        "companion": {"image": {"repository": IMAGE.split(":")[0], "tag": "e2e"}},
        "prometheusRule": {"enabled": "auto"},
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    kubectl("create", "namespace", NS)
    kubectl("-n", NS, "create", "secret", "generic", "vacancyd-lender-tokens",
            f"--from-literal=pc={READ}")  # fmt: skip
    run("helm", "--kube-context", f"kind-{CLUSTER}", "install", "vacancyd", str(CHART),
        "-n", NS, "-f", str(path), "--wait", "--timeout", "180s")  # fmt: skip
    gated = f"http://vacancyd-chat.{NS}.svc/v1/chat/completions"
    direct = f"http://vacancyd-chat-direct.{NS}.svc/v1/chat/completions"
    until(lambda: in_pod(gated) == "200")
    before = len(seen)
    d.state.set_lending(False)
    # the gated Service loses its endpoint: the connection is refused (curl prints 000)
    until(lambda: in_pod(gated) == "000")
    assert in_pod(direct) == "503"  # the -direct Service still reaches it: a reasoned 503
    assert len(seen) == before  # nothing reached the inference server meanwhile
    d.state.set_lending(True)
    until(lambda: in_pod(gated) == "200")
