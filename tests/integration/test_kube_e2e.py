"""Publishing against a real kube-apiserver with the real kubernetes_asyncio client.

Needs kube-apiserver, etcd, kubectl, helm and kubeconform (tools/build-kube-tools.sh); the
tests skip without them and fail with VACANCYD_REQUIRE_TOOLS=1. Outcomes are read the way an
operator reads them: ``kubectl describe node`` and ``kubectl get endpointslices -o json``.
Endpoint addresses are TEST-NET-1 (192.0.2.0/24), written as data only; no traffic is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import config as cfg
from tests.support import kube
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.k8s_lender import BORROW, READ, lender_toml
from vacancyd.config.load import parse_companion_config
from vacancyd.k8s.client import KubeClient
from vacancyd.k8s.companion import Companion

pytestmark = pytest.mark.kube

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "vacancyd"
NS = "vacancyd"
NODE = "gaming-pc"
SA = "vacancyd-companion"


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    kube.require_kube_tools()
    kube.require_kube_tools("helm")
    with kube.running_apiserver(tmp_path_factory.mktemp("apiserver")) as api:
        api.kubectl("create", "namespace", NS)
        yield api


def chart_values(tmp_path: Path, lenders: list[dict[str, str]]) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump({"upstreams": [{"name": "chat", "port": 80}], "lenders": lenders})
    )
    return path


def helm_template(values: Path, *extra: str) -> str:
    helm = kube.require_kube_tools("helm")["helm"]
    proc = subprocess.run(
        [str(helm), "template", "vacancyd", str(CHART), "-n", NS, "-f", str(values), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return proc.stdout


@pytest.fixture(scope="module")
def installed(apiserver: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The chart's objects applied to the server: Services, RBAC, companion and all."""
    values = chart_values(
        tmp_path_factory.mktemp("chart"),
        [{"name": "pc", "url": "http://192.0.2.10:9470", "address": "192.0.2.10", "node": NODE}],
    )
    # What `helm install` creates: no hooks (the uninstall hook Job exists only at uninstall)
    rendered = helm_template(values, "--no-hooks")
    apiserver.kubectl("apply", "--server-side", "-f", "-", input=rendered)
    return apiserver


async def kubectl(api: Any, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """kubectl off the event loop, so lenders and companions keep running meanwhile."""
    result: subprocess.CompletedProcess[str] = await asyncio.to_thread(api.kubectl, *args, **kw)
    return result


def node_manifest(name: str) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})


def make_node(api: Any, name: str) -> None:
    """A Node with a kubelet-style Ready condition that vacancyd must leave alone."""
    api.kubectl("delete", "node", name, "--ignore-not-found")
    api.kubectl("create", "-f", "-", input=node_manifest(name))
    kubelet = {
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ]
        }
    }
    api.kubectl(
        "patch", "node", name, "--subresource=status", "--type=strategic",
        "-p", json.dumps(kubelet),
    )  # fmt: skip


def sa_kubeconfig(api: Any, path: Path) -> Path:
    """A kubeconfig for the chart's ServiceAccount: only the chart's RBAC applies."""
    token = api.kubectl("-n", NS, "create", "token", SA, "--duration=1h").stdout.strip()
    return kube.token_kubeconfig(api, token, path, user="sa")


def companion_toml(
    url: str,
    kubeconfig: Path,
    *,
    name: str = "pc",
    node: str = NODE,
    address: str = "192.0.2.10",
    more: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The companion following lender ``name`` at ``url`` (and the ``more`` lenders) through
    the API server of ``kubeconfig``."""
    return cfg.companion_toml(
        cfg.lender(name, url, READ, address, node=node),
        *more,
        kubernetes={
            "kubeconfig": str(kubeconfig),
            "namespace": NS,
            "heartbeat_s": 60,
            "resync_s": 0.5,
            "request_timeout_s": 5,
            "backoff_max_s": 1,
        },
        lender_timeout_s=1.5,
        status_poll_s=30,
    )


@asynccontextmanager
async def companion_for(toml: str) -> AsyncIterator[Companion]:
    companion = Companion(parse_companion_config(toml, "<test>"))
    await companion.start()
    try:
        yield companion
    finally:
        await companion.stop()


async def eventually(check: Callable[[], Any], timeout_s: float = 15.0) -> Any:
    """Retry an async check until it returns something truthy."""
    last: Any = None
    async with asyncio.timeout(timeout_s):
        while True:
            last = await check()
            if last:
                return last
            await asyncio.sleep(0.2)


async def describe_conditions(api: Any, node: str = NODE) -> dict[str, list[str]]:
    """The Conditions table of ``kubectl describe node``, keyed by type."""
    out = (await kubectl(api, "describe", "node", node)).stdout
    rows: dict[str, list[str]] = {}
    in_table = False
    for line in out.splitlines():
        if line.startswith("Conditions:"):
            in_table = True
            continue
        if in_table:
            if line and not line.startswith(" "):
                break
            cells = line.split()
            if cells and cells[0] not in ("Type", "----"):
                rows[cells[0]] = cells
    return rows


async def slices(api: Any, selector: str = "vacancyd.io/lender=pc") -> dict[str, dict[str, Any]]:
    out = await kubectl(api, "-n", NS, "get", "endpointslices", "-l", selector, "-o", "json")
    return {item["metadata"]["name"]: item for item in json.loads(out.stdout)["items"]}


def ready_of(items: dict[str, dict[str, Any]], name: str) -> bool | None:
    item = items.get(name)
    return None if item is None else item["endpoints"][0]["conditions"].get("ready")


GATED = "vacancyd-chat-pc-chat"
DIRECT = "vacancyd-chat-direct-pc-chat"


async def test_companion_with_chart_rbac_publishes_conditions_and_slices(
    installed: Any, tmp_path: Path
) -> None:
    api = installed
    make_node(api, NODE)
    kubeconfig = sa_kubeconfig(api, tmp_path / "sa.kubeconfig")
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as lender:
        await lender.wait_ready()
        port = int(lender.daemon.bound["chat"].rsplit(":", 1)[1])
        async with companion_for(companion_toml(lender.api_url, kubeconfig)):

            async def lendable() -> dict[str, list[str]] | None:
                rows = await describe_conditions(api)
                row = rows.get("VacancyLendable")
                return rows if row and row[1] == "True" else None

            rows = await eventually(lendable)
            assert "Lendable" in rows["VacancyLendable"]
            assert rows["VacancyOwnerPresent"][1] == "False"
            assert "OwnerAway" in rows["VacancyOwnerPresent"]
            assert rows["Ready"][1] == "True" and "KubeletReady" in rows["Ready"]

            items = await eventually(
                lambda: _slices_where(api, lambda s: ready_of(s, GATED) is True)
            )
            gated = items[GATED]
            assert gated["metadata"]["labels"]["kubernetes.io/service-name"] == "vacancyd-chat"
            assert (
                gated["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"]
                == "companion.vacancyd.io"
            )
            assert gated["endpoints"][0]["addresses"] == ["192.0.2.10"]
            assert gated["endpoints"][0]["nodeName"] == NODE
            assert gated["endpoints"][0]["conditions"]["serving"] is True
            assert gated["ports"] == [{"name": "http", "port": port, "protocol": "TCP"}]
            assert ready_of(items, DIRECT) is True

            node = json.loads((await kubectl(api, "get", "node", NODE, "-o", "json")).stdout)
            first = {c["type"]: c for c in node["status"]["conditions"]}["VacancyLendable"]

            # the owner switches lending off: the gated endpoint goes, the direct one stays
            await asyncio.sleep(1.05)  # Kubernetes times have whole seconds
            lender.state.set_lending(False)

            async def disabled() -> dict[str, list[str]] | None:
                rows = await describe_conditions(api)
                row = rows.get("VacancyLendable", [])
                return rows if "LendingDisabled" in row else None

            rows = await eventually(disabled, 10.0)
            assert rows["VacancyLendable"][1] == "False"
            items = await eventually(
                lambda: _slices_where(api, lambda s: ready_of(s, GATED) is False)
            )
            assert ready_of(items, DIRECT) is True
            node = json.loads((await kubectl(api, "get", "node", NODE, "-o", "json")).stdout)
            now = {c["type"]: c for c in node["status"]["conditions"]}
            assert now["VacancyLendable"]["lastTransitionTime"] != first["lastTransitionTime"]
            assert now["Ready"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"

            # an outside edit of the gated endpoint is repaired on the next resync
            patch = [{"op": "replace", "path": "/endpoints/0/conditions/ready", "value": True}]
            await kubectl(
                api, "-n", NS, "patch", "endpointslice", GATED, "--type=json",
                "-p", json.dumps(patch),
            )  # fmt: skip
            await eventually(lambda: _slices_where(api, lambda s: ready_of(s, GATED) is False))

            # the lender goes away: within lender_timeout_s everything is not ready
            await lender.daemon.shutdown()

            async def unreachable() -> dict[str, list[str]] | None:
                rows = await describe_conditions(api)
                return rows if "LenderUnreachable" in rows.get("VacancyLendable", []) else None

            rows = await eventually(unreachable, 10.0)
            assert rows["VacancyLendable"][1] == "Unknown"
            items = await slices(api)
            assert ready_of(items, GATED) is False and ready_of(items, DIRECT) is False
        # the companion stops cleanly: not lendable
        rows = await describe_conditions(api)
        assert rows["VacancyLendable"][1] == "False" and "Stopped" in rows["VacancyLendable"]


async def _slices_where(
    api: Any, predicate: Callable[[dict[str, dict[str, Any]]], bool]
) -> dict[str, dict[str, Any]] | None:
    items = await slices(api)
    return items if predicate(items) else None


async def test_rbac_denial_is_logged_and_recovers_once_granted(
    installed: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "vacancyd")
    api = installed
    make_node(api, "rbac-pc")
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as lender:
        await lender.wait_ready()
        toml = companion_toml(lender.api_url, api.limited_kubeconfig, node="rbac-pc")
        async with companion_for(toml.replace('name = "pc"', 'name = "rbac"')) as companion:
            await eventually(lambda: _async_true("HTTP 403" in caplog.text))
            assert "lack a permission" in caplog.text
            assert "VacancyLendable" not in await describe_conditions(api, "rbac-pc")
            # admission on the lender is unaffected
            status = json.loads((await _get(f"{lender.api_url}/status", READ)).decode())
            assert status["upstreams"]["chat"]["lendable"] is True
            # grant the chart's roles to the limited user: the companion recovers by itself
            await kubectl(
                api, "create", "clusterrolebinding", "limited-nodes",
                "--clusterrole=vacancyd-vacancyd-node-conditions",
                f"--user={kube.LIMITED_USER}",
            )  # fmt: skip
            await kubectl(
                api, "-n", NS, "create", "rolebinding", "limited-slices",
                "--role=vacancyd-endpointslices", f"--user={kube.LIMITED_USER}",
            )  # fmt: skip

            async def recovered() -> bool:
                rows = await describe_conditions(api, "rbac-pc")
                return rows.get("VacancyLendable", [None, None])[1] == "True"

            await eventually(recovered, 20.0)
            await eventually(lambda: _async_true(companion.followers[0].publisher.healthy))
    assert "written again" in caplog.text


async def _async_true(value: bool) -> bool:
    return value


async def _get(url: str, token: str) -> bytes:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers={"Authorization": f"Bearer {token}"}) as resp:
            return await resp.read()


async def test_missing_node_and_rejected_address(
    installed: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A Node that does not exist, and a loopback address the API server refuses."""
    api = installed
    make_node(api, "loop-pc")
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as lender:
        await lender.wait_ready()
        toml = companion_toml(
            lender.api_url,
            api.kubeconfig,
            name="ghost",
            node="no-such-node",
            address="192.0.2.11",
            more=(
                cfg.lender("loop", lender.api_url, READ, "127.0.0.1", node="loop-pc"),
                cfg.lender("linklocal", lender.api_url, READ, "169.254.10.20"),
            ),
        )
        async with companion_for(toml):
            # the missing Node is reported; the lender's EndpointSlices are still written
            await eventually(lambda: _async_true('nodes "no-such-node" not found' in caplog.text))
            assert "is the Node name right?" in caplog.text
            await eventually(lambda: _ghost_ready(api))
            # the loopback address is rejected by the real server; conditions still land
            await eventually(
                lambda: _async_true(
                    "vacancyd/vacancyd-chat-loop-chat: HTTP 422" in caplog.text
                    and "vacancyd/vacancyd-chat-linklocal-chat: HTTP 422" in caplog.text
                )
            )
            assert "loopback" in caplog.text and "link-local" in caplog.text
            rows = await eventually(lambda: _lendable_rows(api, "loop-pc"))
            assert rows["VacancyLendable"][1] == "True"
            assert await slices(api, "vacancyd.io/lender=loop") == {}
            assert await slices(api, "vacancyd.io/lender=linklocal") == {}


async def _ghost_ready(api: Any) -> bool:
    items = await slices(api, "vacancyd.io/lender=ghost")
    return ready_of(items, "vacancyd-chat-ghost-chat") is True


async def _lendable_rows(api: Any, node: str) -> dict[str, list[str]] | None:
    rows = await describe_conditions(api, node)
    return rows if rows.get("VacancyLendable", [None, None])[1] == "True" else None


def pointed_at(kubeconfig: Path, server: str, dest: Path) -> Path:
    """A copy of ``kubeconfig`` whose cluster is ``server``."""
    doc = json.loads(Path(kubeconfig).read_text())
    doc["clusters"][0]["cluster"]["server"] = server
    dest.write_text(json.dumps(doc))
    return dest


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An "API server" that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"https://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


async def test_host_side_publishing_and_a_slow_api_server(
    installed: Any, tmp_path: Path, silent_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon publishes itself from a kubeconfig; a hung API server never slows it."""
    api = installed
    make_node(api, "host-pc")
    section = {
        "kubeconfig": str(api.kubeconfig),
        "namespace": NS,
        "node": "host-pc",
        "address": "192.0.2.12",
        "lender": "host",
        "resync_s": 0.5,
    }
    app, seen = openai_like_app()
    async with serve_app(app) as target:
        async with running_daemon(lender_toml(target, kubernetes=section)) as lender:
            await lender.wait_ready()
            rows = await eventually(lambda: _lendable_rows(api, "host-pc"))
            assert "Lendable" in rows["VacancyLendable"]
            items = await eventually(
                lambda: _slices_where_sel(api, "vacancyd.io/lender=host", "vacancyd-chat-host-chat")
            )
            assert items["vacancyd-chat-host-chat"]["endpoints"][0]["addresses"] == ["192.0.2.12"]
        rows = await describe_conditions(api, "host-pc")
        assert rows["VacancyLendable"][1] == "False" and "Stopped" in rows["VacancyLendable"]

        # now an API server that never answers: requests through the proxy stay fast
        hung = pointed_at(api.kubeconfig, silent_server, tmp_path / "hung.kubeconfig")
        slow = {**section, "kubeconfig": str(hung), "request_timeout_s": 0.5}
        async with running_daemon(lender_toml(target, kubernetes=slow)) as lender:
            await lender.wait_ready()
            import aiohttp

            loop = asyncio.get_running_loop()
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    started = loop.time()
                    async with http.post(
                        f"{lender.proxy_url('chat')}/v1/chat/completions",
                        json={"model": "tiny", "messages": []},
                        headers={"Authorization": f"Bearer {BORROW}"},
                    ) as resp:
                        assert resp.status == 200
                    assert loop.time() - started < 0.5
            await eventually(lambda: _async_true("no answer within 0.5 s" in caplog.text), 10)
            assert not lender.daemon.supervisor.failed.is_set()
    assert len(seen) == 3


async def _slices_where_sel(api: Any, selector: str, name: str) -> dict[str, Any] | None:
    items = await slices(api, selector)
    return items if ready_of(items, name) is True else None


async def test_kube_client_wraps_errors(installed: Any, tmp_path: Path) -> None:
    """K8sApiError carries the server's status and message (403, 404)."""
    from vacancyd.k8s.api import K8sApiError

    limited = await KubeClient.connect(installed.limited_kubeconfig)
    admin = await KubeClient.connect(installed.kubeconfig)
    try:
        with pytest.raises(K8sApiError) as denied:
            # outside the namespace any test granted it: the chart's Role is namespaced
            await limited.list_endpoint_slices("default", "a=b")
        assert denied.value.status == 403 and "forbidden" in denied.value.message
        with pytest.raises(K8sApiError) as missing:
            await admin.get_node_conditions("nobody")
        assert missing.value.status == 404 and "not found" in missing.value.message
        await admin.delete_endpoint_slice(NS, "does-not-exist")  # 404 is not an error
    finally:
        await limited.close()
        await admin.close()
    with pytest.raises(K8sApiError) as bad:
        await KubeClient.connect(tmp_path / "missing.kubeconfig")
    assert bad.value.status is None


def test_chart_renders_valid_objects_and_applies(apiserver: Any, tmp_path: Path) -> None:
    """Every values file renders objects the API server's own schemas accept (kubeconform,
    strict), and the rendered Services, RBAC and EndpointSlices apply to the real server."""
    tools = kube.require_kube_tools("kubeconform", "helm")
    location = kube.write_kubeconform_schemas(apiserver, tmp_path / "schemas")
    values_files = [*sorted((CHART / "ci").glob("*.yaml")), ROOT / "manifests" / "values.yaml"]
    for values in values_files:
        rendered = helm_template(values)
        proc = subprocess.run(
            [
                str(tools["kubeconform"]), "-schema-location", location, "-strict",
                "-skip", "PrometheusRule,ServiceMonitor", "-output", "json", "-summary", "-",
            ],
            input=rendered, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        summary = json.loads(proc.stdout)["summary"]
        assert summary["invalid"] == 0 and summary["errors"] == 0, (values, proc.stdout)
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        # the Prometheus Operator's kinds need its CRDs, which this API server does not have
        operator_kinds = {"PrometheusRule", "ServiceMonitor"}
        assert summary["valid"] == len([d for d in docs if d["kind"] not in operator_kinds])
        # apply with the server's own validation (dry run: the module's install is separate)
        applicable = [d for d in docs if d["kind"] not in operator_kinds]
        apiserver.kubectl(
            "apply", "--server-side", "--dry-run=server", "-f", "-",
            input=yaml.safe_dump_all(applicable),
        )  # fmt: skip
    # an EndpointSlice exactly as the publisher writes it applies too
    from vacancyd.core.conditions import SliceTarget, endpoint_slice

    body = endpoint_slice(
        lender="pc", upstream="chat", namespace=NS, target=SliceTarget("vacancyd-chat"),
        address="192.0.2.10", port=11435, ready=True, serving=True,
    )  # fmt: skip
    apiserver.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(body))


async def test_two_lenders_behind_one_service(installed: Any) -> None:
    """Scale-out: one companion, two lenders, one EndpointSlice each in the same Services."""
    api = installed
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        async with (
            running_daemon(lender_toml(target)) as a,
            running_daemon(lender_toml(target)) as b,
        ):
            await a.wait_ready()
            await b.wait_ready()
            toml = cfg.companion_toml(
                cfg.lender("pc-a", a.api_url, READ, "192.0.2.21"),
                cfg.lender("pc-b", b.api_url, READ, "192.0.2.22"),
                kubernetes={
                    "kubeconfig": str(api.kubeconfig),
                    "namespace": NS,
                    "resync_s": 0.5,
                },
                lender_timeout_s=2,
                status_poll_s=30,
            )
            async with companion_for(toml):
                b.state.set_lending(False)
                selector = "kubernetes.io/service-name=vacancyd-chat"

                async def split() -> dict[str, dict[str, Any]] | None:
                    items = await slices(api, selector)
                    want = {"vacancyd-chat-pc-a-chat": True, "vacancyd-chat-pc-b-chat": False}
                    got = {name: ready_of(items, name) for name in want}
                    return items if got == want else None

                items = await eventually(split)
                ours = [i for n, i in items.items() if "-pc-a-" in n or "-pc-b-" in n]
                addresses = sorted(i["endpoints"][0]["addresses"][0] for i in ours)
                assert addresses == ["192.0.2.21", "192.0.2.22"]
                direct = await slices(api, "kubernetes.io/service-name=vacancyd-chat-direct")
                assert ready_of(direct, "vacancyd-chat-direct-pc-a-chat") is True
                assert ready_of(direct, "vacancyd-chat-direct-pc-b-chat") is True


async def test_companion_process_publishes_and_stops_cleanly(
    installed: Any, tmp_path: Path
) -> None:
    """`vacancyd companion --config` as a real process: publishes, and on SIGTERM marks the
    lender Stopped and exits 0."""
    import signal
    import sys

    api = installed
    make_node(api, "proc-pc")
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as lender:
        await lender.wait_ready()
        config = tmp_path / "companion.toml"
        config.write_text(
            companion_toml(lender.api_url, api.kubeconfig, name="proc", node="proc-pc")
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "vacancyd", "companion", "--config", str(config),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        try:
            rows = await eventually(lambda: _lendable_rows(api, "proc-pc"), 30.0)
            assert "Lendable" in rows["VacancyLendable"]
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                out, _ = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, out.decode()
        assert b"stopping on signal" in out
        rows = await describe_conditions(api, "proc-pc")
        assert rows["VacancyLendable"][1] == "False" and "Stopped" in rows["VacancyLendable"]


async def test_in_cluster_auth_with_the_service_account(
    installed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-cluster auth: in a Pod (KUBERNETES_SERVICE_HOST set, no kubeconfig) the mounted
    ServiceAccount
    token is used, and the chart's Role is all it may do."""
    from vacancyd.k8s.api import K8sApiError

    api = installed
    mount = tmp_path / "serviceaccount"
    mount.mkdir()
    token = api.kubectl("-n", NS, "create", "token", SA, "--duration=1h").stdout.strip()
    (mount / "token").write_text(token)
    (mount / "ca.crt").write_bytes(api.ca_file.read_bytes())
    host, port = api.url.removeprefix("https://").rsplit(":", 1)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    client = await KubeClient.connect(service_account_dir=mount)
    try:
        assert isinstance(await client.list_endpoint_slices(NS, "a=b"), list)
        with pytest.raises(K8sApiError) as denied:
            await client.list_endpoint_slices("default", "a=b")
        assert denied.value.status == 403
    finally:
        await client.close()


def test_helm_test_pod_passes_restricted_pod_security(apiserver: Any, tmp_path: Path) -> None:
    """The ``helm test`` pod is admitted where the "restricted" Pod Security level is
    enforced, by the API server's own PodSecurity admission; the check is real: the same pod
    without its security context is rejected there."""
    ns = "restricted-lending"
    apiserver.kubectl("create", "namespace", ns)
    apiserver.kubectl(
        "label", "namespace", ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )  # fmt: skip
    helm = kube.require_kube_tools("helm")["helm"]
    values = chart_values(tmp_path, [{"name": "pc", "url": "http://192.0.2.10:9470"}])
    rendered = subprocess.run(
        [
            str(helm), "template", "vacancyd", str(CHART), "-n", ns, "-f", str(values),
            "--show-only", "templates/tests/test-direct-health.yaml",
        ],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    pods = [d for d in yaml.safe_load_all(rendered) if d]
    assert pods and all(p["kind"] == "Pod" for p in pods)
    for pod in pods:
        apiserver.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(pod))
    loose = json.loads(json.dumps(pods[0]))
    del loose["spec"]["securityContext"]
    del loose["spec"]["containers"][0]["securityContext"]
    with pytest.raises(AssertionError, match="violates PodSecurity"):
        apiserver.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(loose))


# -- upkeep: stale conditions and uninstall -------------------------------------------------

OLD = "2026-01-01T00:00:00Z"


def set_conditions(api: Any, node: str, conds: list[dict[str, str]]) -> None:
    """Patch ``conds`` into the Node's status (merged by type, as any writer would)."""
    api.kubectl(
        "patch", "node", node, "--subresource=status", "--type=strategic",
        "-p", json.dumps({"status": {"conditions": conds}}),
    )  # fmt: skip


def node_conditions(api: Any, node: str) -> dict[str, dict[str, Any]]:
    doc = json.loads(api.kubectl("get", "node", node, "-o", "json").stdout)
    return {c["type"]: c for c in doc["status"]["conditions"]}


def condition(kind: str, status: str, reason: str, heartbeat: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": f"{kind} as its writer left it",
        "lastHeartbeatTime": heartbeat,
        "lastTransitionTime": OLD,
    }


async def vacancyd_cli(*args: str) -> tuple[int, str, str]:
    """``python -m vacancyd ARGS`` as a real process: (exit code, stdout, stderr)."""
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vacancyd", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_mark_stale_turns_a_silent_publishers_conditions_unknown(
    installed: Any, tmp_path: Path
) -> None:
    """A host-side lender switched off at the wall: its VacancyLendable stays True, and
    nobody but `vacancyd k8s mark-stale` resets it. Only our stale conditions change; the
    publisher's next write wins again."""
    from datetime import UTC, datetime

    api = installed
    make_node(api, "wall-pc")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    set_conditions(
        api,
        "wall-pc",
        [
            condition("VacancyLendable", "True", "Lendable", OLD),
            condition("VacancyOwnerPresent", "False", "OwnerAway", now),
            condition("ExampleCondition", "True", "SomeoneElses", OLD),
        ],
    )
    kubeconfig = sa_kubeconfig(api, tmp_path / "sa.kubeconfig")  # the chart's RBAC only
    argv = ("k8s", "mark-stale", "--node=wall-pc", "--stale-after-s=60")
    code, out, err = await vacancyd_cli(*argv, f"--kubeconfig={kubeconfig}")
    assert code == 0, err
    assert json.loads(out) == {
        "action": "mark-stale", "changed": ["wall-pc"], "unchanged": [], "errors": [],
    }  # fmt: skip
    conds = node_conditions(api, "wall-pc")
    lendable = conds["VacancyLendable"]
    assert (lendable["status"], lendable["reason"]) == ("Unknown", "PublisherStale")
    assert lendable["lastHeartbeatTime"] == OLD  # when its publisher last vouched for it
    assert lendable["lastTransitionTime"] != OLD
    assert "it last said True (Lendable)" in lendable["message"]
    assert conds["VacancyOwnerPresent"]["status"] == "False"  # fresh: left alone
    assert conds["ExampleCondition"] == condition("ExampleCondition", "True", "SomeoneElses", OLD)
    assert conds["Ready"]["reason"] == "KubeletReady"
    rows = await describe_conditions(api, "wall-pc")
    assert rows["VacancyLendable"][1] == "Unknown" and "PublisherStale" in rows["VacancyLendable"]
    # a second pass changes nothing; a Node that does not exist is an error (exit 1)
    code, out, _ = await vacancyd_cli(*argv, f"--kubeconfig={kubeconfig}")
    assert code == 0 and json.loads(out)["unchanged"] == ["wall-pc"]
    code, out, _ = await vacancyd_cli(*argv, "--node=no-such-pc", f"--kubeconfig={kubeconfig}")
    assert code == 1 and "not found" in json.loads(out)["errors"][0]

    # the lender comes back: its own write puts its state back over PublisherStale
    section = {"kubeconfig": str(api.kubeconfig), "namespace": NS, "node": "wall-pc"}
    section["lender"] = "wall"
    app, _ = openai_like_app()
    async with (
        serve_app(app) as target,
        running_daemon(lender_toml(target, kubernetes=section)) as d,
    ):
        await d.wait_ready()
        rows = await eventually(lambda: _lendable_rows(api, "wall-pc"))
        assert "Lendable" in rows["VacancyLendable"]


async def test_mark_stale_loses_to_a_publisher_that_writes_meanwhile(installed: Any) -> None:
    """The patch carries the resourceVersion it read: a heartbeat that lands between the
    read and the patch makes the real API server refuse it (409), and the fresh True stays."""
    from datetime import UTC, datetime

    from vacancyd.k8s import maintenance

    api = installed
    make_node(api, "race-pc")
    set_conditions(api, "race-pc", [condition("VacancyLendable", "True", "Lendable", OLD)])
    client = await KubeClient.connect(installed.kubeconfig)

    class Racing:
        """The real client; the publisher heartbeats right after the check's read."""

        def __init__(self) -> None:
            self.reads = 0

        async def read_node_status(self, node: str) -> Any:
            got = await client.read_node_status(node)
            self.reads += 1
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            fresh = condition("VacancyLendable", "True", "Lendable", now)
            await asyncio.to_thread(set_conditions, api, node, [fresh])
            return got

        async def patch_node_status(self, node: str, patch: Any) -> None:
            await client.patch_node_status(node, patch)

    try:
        racing = Racing()
        outcome = await maintenance.mark_stale(racing, ["race-pc"], 60.0)  # type: ignore[arg-type]
        assert racing.reads == 1
        assert outcome.changed == [] and outcome.unchanged == ["race-pc"] and outcome.ok
        assert node_conditions(api, "race-pc")["VacancyLendable"]["status"] == "True"
        # without the race the same pass marks it (the heartbeat above is fresh, so age it)
        set_conditions(api, "race-pc", [condition("VacancyLendable", "True", "Lendable", OLD)])
        outcome = await maintenance.mark_stale(client, ["race-pc"], 60.0)
        assert outcome.changed == ["race-pc"]
    finally:
        await client.close()


async def test_the_uninstall_hook_removes_vacancyds_objects_and_only_those(
    installed: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`helm uninstall` order: the pre-delete hook's command (rendered by the chart, run with
    the companion's ServiceAccount) while the companion still runs, then the companion
    stops. Afterwards no EndpointSlice or Node condition of vacancyd is left, and other
    writers' conditions and slices are untouched."""
    api = installed
    make_node(api, "gone-pc")
    set_conditions(
        api,
        "gone-pc",
        [
            condition("VacancyOldName", "True", "Retired", OLD),
            condition("ExampleCondition", "True", "SomeoneElses", OLD),
        ],
    )
    foreign = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "someone-elses",
            "namespace": NS,
            "labels": {
                "kubernetes.io/service-name": "vacancyd-chat",
                "endpointslice.kubernetes.io/managed-by": "other-controller.example.com",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["192.0.2.99"], "conditions": {"ready": True}}],
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
    }
    api.kubectl("apply", "-f", "-", input=json.dumps(foreign))
    values = chart_values(
        tmp_path,
        [{"name": "gone", "url": "http://192.0.2.13:9470", "address": "192.0.2.13",
          "node": "gone-pc"}],
    )  # fmt: skip
    helm = kube.require_kube_tools("helm")["helm"]
    rendered = subprocess.run(  # noqa: ASYNC221 - before anything runs on the loop
        [str(helm), "template", "vacancyd", str(CHART), "-n", NS, "-f", str(values),
         "--show-only", "templates/cleanup-hook.yaml"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    (job,) = [d for d in yaml.safe_load_all(rendered) if d]
    assert job["kind"] == "Job"
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == SA
    args = pod["containers"][0]["args"]
    assert args[:2] == ["k8s", "cleanup"] and "--node=gone-pc" in args

    kubeconfig = sa_kubeconfig(api, tmp_path / "sa.kubeconfig")
    app, _ = openai_like_app()
    async with serve_app(app) as target, running_daemon(lender_toml(target)) as lender:
        await lender.wait_ready()
        toml = companion_toml(
            lender.api_url, kubeconfig, name="gone", node="gone-pc", address="192.0.2.13"
        )
        async with companion_for(toml):
            await eventually(lambda: _lendable_rows(api, "gone-pc"))
            await eventually(
                lambda: _slices_where_sel(api, "vacancyd.io/lender=gone", "vacancyd-chat-gone-chat")
            )
            code, out, err = await vacancyd_cli(*args, f"--kubeconfig={kubeconfig}")
            assert code == 0, err
            report = json.loads(out)
            # every lender's slices in the namespace go (other tests' lenders' too)
            assert {
                "endpointslice/vacancyd-chat-direct-gone-chat",
                "endpointslice/vacancyd-chat-gone-chat",
                "node/gone-pc",
            } <= set(report["changed"])
            assert "endpointslice/someone-elses" not in report["changed"]
            assert report["errors"] == []
            # the companion (resyncing every 0.5 s) saw the marker and stopped writing
            assert "an uninstall is removing what vacancyd published" in caplog.text
        # the companion has stopped: it wrote nothing back, not even its last state
    assert await slices(api, "vacancyd.io/lender=gone") == {}
    ours = "endpointslice.kubernetes.io/managed-by=companion.vacancyd.io"
    assert await slices(api, ours) == {}  # the uninstall marker too
    assert "someone-elses" in await slices(api, "kubernetes.io/service-name=vacancyd-chat")
    conds = node_conditions(api, "gone-pc")
    assert not [kind for kind in conds if kind.startswith("Vacancy")]
    assert conds["ExampleCondition"] == condition("ExampleCondition", "True", "SomeoneElses", OLD)
    assert conds["Ready"]["reason"] == "KubeletReady"
    # nothing left: a second run changes nothing
    code, out, _ = await vacancyd_cli(*args, f"--kubeconfig={kubeconfig}")
    report = json.loads(out)
    assert code == 0 and report["changed"] == [] and report["unchanged"] == ["node/gone-pc"]


async def test_mark_stale_every_repeats_until_sigterm(installed: Any, tmp_path: Path) -> None:
    """`--every S` runs a pass every S seconds (one JSON line each) and exits 0 on SIGTERM."""
    import signal
    import sys

    api = installed
    make_node(api, "every-pc")
    set_conditions(api, "every-pc", [condition("VacancyLendable", "True", "Lendable", OLD)])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vacancyd", "k8s", "mark-stale", "--node=every-pc",
        "--every=0.3", f"--kubeconfig={api.kubeconfig}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(30):
            first = json.loads(await proc.stdout.readline())
            second = json.loads(await proc.stdout.readline())
        assert first["changed"] == ["every-pc"] and second["unchanged"] == ["every-pc"]
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    assert node_conditions(api, "every-pc")["VacancyLendable"]["reason"] == "PublisherStale"
