"""Routing borrowers away, against a real kube-apiserver: docs/kubernetes.md followed word
for word (without and with the Prometheus Operator's API, and host-side publishing with the
chart's own RBAC), and fifty lenders behind one Service converging when half of them flip,
with kube-proxy's endpoint selection applied to what was published.

Needs kube-apiserver, etcd, kubectl and helm (tools/build-kube-tools.sh); skipped without
them, failed with VACANCYD_REQUIRE_TOOLS=1. No controllers or kubelet run, so nothing here
starts a Pod: ``helm test`` and the companion Deployment's Pod are not exercised.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support import config as cfg
from tests.support import kube
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.k8s_lender import READ, lender_toml
from vacancyd.config.load import parse_companion_config
from vacancyd.k8s.companion import Companion

pytestmark = pytest.mark.kube

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "vacancyd"
DOC = ROOT / "docs" / "kubernetes.md"
NS = "vacancyd"

#: A minimal CustomResourceDefinition for monitoring.coreos.com/v1 PrometheusRule: what the
#: Prometheus Operator's CRDs make the API server serve (schema left open).
PROMETHEUS_RULE_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "prometheusrules.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {
            "kind": "PrometheusRule",
            "listKind": "PrometheusRuleList",
            "plural": "prometheusrules",
            "singular": "prometheusrule",
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    kube.require_kube_tools()
    kube.require_kube_tools("helm")
    with kube.running_apiserver(tmp_path_factory.mktemp("apiserver")) as api:
        yield api


def heredoc(name: str) -> str:
    """The text docs/kubernetes.md writes with ``cat > NAME <<'EOF'``, exactly."""
    match = re.search(rf"cat > {re.escape(name)} <<'EOF'\n(.*?)\nEOF\n", DOC.read_text(), re.S)
    assert match, f"docs/kubernetes.md no longer writes {name}"
    return match.group(1) + "\n"


def helm(api: Any, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = kube.require_kube_tools("helm")["helm"]
    proc = subprocess.run(
        [str(binary), f"--kubeconfig={api.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if check and proc.returncode:
        raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def test_the_documented_install_works_without_and_with_the_operator(
    apiserver: Any, tmp_path: Path
) -> None:
    api = apiserver
    values = tmp_path / "my-values.yaml"
    values.write_text(heredoc("my-values.yaml"))
    token = tmp_path / "gaming-pc-read.token"
    token.write_text("r" * 24)
    # the documented steps, on a cluster without the Prometheus Operator
    api.kubectl("create", "namespace", NS)
    api.kubectl(
        "-n", NS, "create", "secret", "generic", "vacancyd-lender-tokens",
        f"--from-file=gaming-pc={token}",
    )  # fmt: skip
    helm(api, "install", "vacancyd", str(CHART), "-n", NS, "-f", str(values))
    manifest = helm(api, "get", "manifest", "vacancyd", "-n", NS).stdout
    assert "kind: PrometheusRule" not in manifest
    assert "kind: Deployment" in manifest
    # the same values once the cluster serves the operator's API: the rule is installed
    api.kubectl("apply", "-f", "-", input=json.dumps(PROMETHEUS_RULE_CRD))
    api.kubectl(
        "wait", "--for=condition=Established", "--timeout=30s",
        "crd/prometheusrules.monitoring.coreos.com",
    )  # fmt: skip
    helm(api, "upgrade", "vacancyd", str(CHART), "-n", NS, "-f", str(values))
    rules = json.loads(api.kubectl("-n", NS, "get", "prometheusrules", "-o", "json").stdout)
    assert [r["metadata"]["name"] for r in rules["items"]] == ["vacancyd"]
    # the pre-delete cleanup hook runs (played here by running its command)
    with kube.running_hook_jobs(api, NS, tmp_path) as hooks:
        helm(api, "uninstall", "vacancyd", "-n", NS)
    assert [h.returncode for h in hooks] == [0], [h.output for h in hooks]
    api.kubectl("delete", "-f", "-", input=json.dumps(PROMETHEUS_RULE_CRD))


def make_node(api: Any, name: str) -> None:
    api.kubectl("delete", "node", name, "--ignore-not-found")
    manifest = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
    api.kubectl("create", "-f", "-", input=json.dumps(manifest))


async def kubectl_json(api: Any, *args: str) -> Any:
    proc = await asyncio.to_thread(api.kubectl, *args, "-o", "json")  # type: ignore[call-arg]
    return json.loads(proc.stdout)


async def eventually(check: Any, timeout_s: float = 15.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while True:
            value = await check()
            if value:
                return value
            await asyncio.sleep(0.1)


async def test_host_side_publishing_with_the_documented_chart_rbac(
    apiserver: Any, tmp_path: Path
) -> None:
    """The host-side values from the docs; the lender publishes as the chart's
    ServiceAccount and can touch its own Node only."""
    api = apiserver
    values = tmp_path / "host-values.yaml"
    values.write_text(heredoc("host-values.yaml"))
    helm(api, "install", "vacancyd", str(CHART), "-n", NS, "--create-namespace", "-f", str(values))
    secret = json.loads(
        api.kubectl("-n", NS, "get", "secret", "vacancyd-host-publisher-token", "-o", "json").stdout
    )
    assert secret["type"] == "kubernetes.io/service-account-token"
    # No token controller runs here to fill that Secret; the TokenRequest API stands in.
    token = api.kubectl("-n", NS, "create", "token", "vacancyd-host-publisher").stdout.strip()
    kubeconfig = kube.token_kubeconfig(api, token, tmp_path / "host.kubeconfig")
    make_node(api, "gaming-pc")
    make_node(api, "someone-else")
    section = {
        "kubeconfig": str(kubeconfig),
        "namespace": NS,
        "node": "gaming-pc",
        "address": "192.0.2.30",
        "lender": "gaming-pc",
        "resync_s": 0.5,
    }
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        async with running_daemon(lender_toml(target, kubernetes=section)) as d:
            await d.wait_ready()

            async def published() -> Any:
                node = await kubectl_json(api, "get", "node", "gaming-pc")
                conds = {c["type"]: c for c in node["status"].get("conditions", [])}
                items = await kubectl_json(
                    api, "-n", NS, "get", "endpointslices", "-l", "vacancyd.io/lender=gaming-pc"
                )
                ready = [
                    i["endpoints"][0]["conditions"]
                    for i in items["items"]
                    if i["metadata"]["name"] == "vacancyd-chat-gaming-pc-chat"
                ]
                ok = conds.get("VacancyLendable", {}).get("status") == "True"
                return ok and ready == [{"ready": True, "serving": True, "terminating": False}]

            await eventually(published)
            assert d.daemon.kubernetes is not None and d.daemon.kubernetes.publisher.healthy
        node = await kubectl_json(api, "get", "node", "gaming-pc")
        conds = {c["type"]: c for c in node["status"]["conditions"]}
        assert conds["VacancyLendable"]["reason"] == "Stopped"
    # least privilege: the same identity may not patch a Node it was not given
    kubectl = kube.kube_tool("kubectl")
    assert kubectl is not None
    denied = await asyncio.to_thread(
        subprocess.run,
        [
            str(kubectl), f"--kubeconfig={kubeconfig}", "patch", "node", "someone-else",
            "--subresource=status", "--type=strategic", "-p", '{"status":{"conditions":[]}}',
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
    # the pre-delete cleanup hook runs (played here by running its command)
    with kube.running_hook_jobs(api, NS, tmp_path) as hooks:
        helm(api, "uninstall", "vacancyd", "-n", NS)
    assert [h.returncode for h in hooks] == [0], [h.output for h in hooks]
    # ... as the host publisher, and it left nothing of vacancyd's behind
    assert hooks[0].job == "vacancyd-host-cleanup"
    node = await kubectl_json(api, "get", "node", "gaming-pc")
    assert node["status"].get("conditions", []) == []  # it had only vacancyd's
    left = await kubectl_json(api, "-n", NS, "get", "endpointslices", "-l", "vacancyd.io/lender")
    assert left["items"] == []


# -- many lenders ------------------------------------------------------------------------

LENDERS = 50


class SimulatedLender:
    """A real HTTP listener that answers /status and /events like a vacancyd lender, with
    one upstream ``chat`` whose lendability the test flips."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.lendable = True
        self._changed: asyncio.Event = asyncio.Event()
        self._streams: list[asyncio.Queue[bytes]] = []

    @property
    def name(self) -> str:
        return f"pc{self.index:02d}"

    @property
    def address(self) -> str:
        return f"192.0.2.{self.index + 1}"

    def status(self) -> dict[str, Any]:
        up: dict[str, Any] = {
            "lendable": self.lendable,
            "listener": {"address": f"0.0.0.0:{11000 + self.index}", "bound": True},
        }
        if not self.lendable:
            up["refusal"] = {"reason": "owner_active", "retry_after_s": 120, "detail": "busy"}
        return {
            "lending_enabled": True,
            "stopping": False,
            "presence": {"sampled": True, "veto": {"active": not self.lendable}},
            "resources": {},
            "upstreams": {"chat": up},
        }

    def flip(self, lendable: bool) -> None:
        self.lendable = lendable
        for queue in self._streams:
            queue.put_nowait(b'event: veto\ndata: {"kind": "veto"}\n\n')

    def app(self) -> web.Application:
        async def status(_: web.Request) -> web.Response:
            return web.json_response(self.status())

        async def events(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'event: hello\ndata: {"keepalive_s": 5}\n\n')
            queue: asyncio.Queue[bytes] = asyncio.Queue()
            self._streams.append(queue)
            try:
                while True:
                    try:
                        async with asyncio.timeout(5):
                            await resp.write(await queue.get())
                    except TimeoutError:
                        await resp.write(b": keepalive\n\n")
            except ConnectionResetError:  # the companion went away
                return resp
            finally:
                self._streams.remove(queue)

        app = web.Application()
        app.router.add_get("/status", status)
        app.router.add_get("/events", events)
        return app


@asynccontextmanager
async def serving(lenders: list[SimulatedLender]) -> AsyncIterator[list[str]]:
    runners = []
    urls = []
    try:
        for lender in lenders:
            runner = web.AppRunner(lender.app(), handle_signals=False, shutdown_timeout=0.1)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        yield urls
    finally:
        await asyncio.gather(*(r.cleanup() for r in runners), return_exceptions=True)


def kube_proxy_endpoints(slices: list[dict[str, Any]], service: str) -> set[str]:
    """The endpoints kube-proxy sends a Service's traffic to, from its EndpointSlices.

    kube-proxy's rule (pkg/proxy/topology.go, CategorizeEndpoints): use the endpoints that
    are ``ready``; only when none is ready, fall back to those that are ``serving`` and
    ``terminating``. An absent ``ready`` counts as ready.
    """
    eps = [
        ep
        for s in slices
        if s["metadata"]["labels"].get("kubernetes.io/service-name") == service
        for ep in s.get("endpoints", [])
    ]

    def cond(ep: dict[str, Any], key: str, default: bool) -> bool:
        value = ep.get("conditions", {}).get(key)
        return default if value is None else bool(value)

    ready = {a for ep in eps if cond(ep, "ready", True) for a in ep["addresses"]}
    if ready:
        return ready
    return {
        a
        for ep in eps
        if cond(ep, "serving", True) and cond(ep, "terminating", False)
        for a in ep["addresses"]
    }


async def test_fifty_lenders_behind_one_service_converge_when_half_flip(
    apiserver: Any, tmp_path: Path, record_property: Any
) -> None:
    api = apiserver
    api.kubectl("create", "namespace", "many", check=False)
    lenders = [SimulatedLender(i) for i in range(LENDERS)]
    async with serving(lenders) as urls:
        toml = cfg.companion_toml(
            *(
                cfg.lender(lender.name, url, READ, lender.address)
                for lender, url in zip(lenders, urls, strict=True)
            ),
            kubernetes={
                "kubeconfig": str(api.kubeconfig),
                "namespace": "many",
                "direct_services": True,
                "heartbeat_s": 60,
                "resync_s": 60,
                "request_timeout_s": 10,
                "lendable_stable_s": 0,
            },
            lender_timeout_s=10,
            status_poll_s=30,
        )
        companion = Companion(parse_companion_config(toml, "<test>"))
        await companion.start()
        loop = asyncio.get_running_loop()
        try:

            async def published() -> list[dict[str, Any]]:
                doc = await kubectl_json(api, "-n", "many", "get", "endpointslices")
                items: list[dict[str, Any]] = doc["items"]
                return items

            async def converged(want: set[str]) -> list[dict[str, Any]] | None:
                items = await published()
                gated = [
                    s
                    for s in items
                    if s["metadata"]["labels"]["kubernetes.io/service-name"] == "vacancyd-chat"
                ]
                if len(gated) != LENDERS:
                    return None
                return items if kube_proxy_endpoints(items, "vacancyd-chat") == want else None

            everyone = {lender.address for lender in lenders}
            started = loop.time()
            await eventually(lambda: converged(everyone), 60.0)
            first_s = loop.time() - started

            def writes() -> int:
                return sum(
                    f.publisher.calls.get("apply", 0) + f.publisher.calls.get("delete", 0)
                    for f in companion.followers
                )

            # the first publication may still be writing (the -direct slices) when the gated
            # ones have converged: count the flip's writes only once it has settled
            async def settled() -> bool:
                seen = writes()
                await asyncio.sleep(1.0)
                return writes() == seen

            await eventually(settled, 60.0)
            before = writes()
            flipped = lenders[::2]
            for lender in flipped:
                lender.flip(False)
            began = loop.time()
            want = everyone - {lender.address for lender in flipped}
            items = await eventually(lambda: converged(want), 30.0)
            converge_s = loop.time() - began
            per_flip = (writes() - before) / len(flipped)

            # kube-proxy's selection on what was published: traffic reaches only ready
            # lenders; the -direct Service still has all of them
            chosen = kube_proxy_endpoints(items, "vacancyd-chat")
            pick = random.Random(14)
            sent = [pick.choice(sorted(chosen)) for _ in range(10_000)]
            assert set(sent) <= want and set(sent) == want
            assert kube_proxy_endpoints(items, "vacancyd-chat-direct") == everyone
            # and back: the other half flips back to lendable
            for lender in flipped:
                lender.flip(True)
            began = loop.time()
            await eventually(lambda: converged(everyone), 30.0)
            back_s = loop.time() - began
        finally:
            await companion.stop()
    figures = {
        "lenders": LENDERS,
        "first_publish_s": round(first_s, 2),
        "half_flip_converge_s": round(converge_s, 2),
        "flip_back_converge_s": round(back_s, 2),
        "api_writes_per_flip": round(per_flip, 2),
    }
    record_property("figures", figures)
    print("many-lenders figures:", json.dumps(figures))
    # one write per flipped lender: its gated slice (the -direct one does not change)
    assert per_flip == 1.0
    assert converge_s < 10.0 and back_s < 10.0
    # after the companion stops, every endpoint is published not ready
    items = await published_after_stop(api)
    assert kube_proxy_endpoints(items, "vacancyd-chat") == set()


async def published_after_stop(api: Any) -> list[dict[str, Any]]:
    doc = await kubectl_json(api, "-n", "many", "get", "endpointslices")
    items: list[dict[str, Any]] = doc["items"]
    return items
