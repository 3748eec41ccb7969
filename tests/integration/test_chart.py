"""The Helm chart, the plain manifests and the alert rules.

Needs helm and promtool from tools/build-kube-tools.sh (skipped without them, failed with
VACANCYD_REQUIRE_TOOLS=1). Validation against the API server's own schemas, and applying the
rendered objects to a real API server, are in test_kube_e2e.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import kube
from vacancyd.config.load import parse_companion_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "vacancyd"
VALUES = [None, *sorted((CHART / "ci").glob("*.yaml")), ROOT / "manifests" / "values.yaml"]


def tool(name: str) -> str:
    """The tool's path (skips the test without it, fails with VACANCYD_REQUIRE_TOOLS=1)."""
    return str(kube.require_kube_tools(name)[name])


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def render(values: Path | None, *extra: str) -> list[dict[str, Any]]:
    args = [tool("helm"), "template", "vacancyd", str(CHART), "--namespace", "vacancy"]
    if values is not None:
        args += ["-f", str(values)]
    out = run(*args, *extra).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def ids(values: Path | None) -> str:
    return "defaults" if values is None else values.name


@pytest.mark.parametrize("values", VALUES, ids=ids)
def test_helm_lint(values: Path | None) -> None:
    args = [tool("helm"), "lint", "--strict", str(CHART)]
    if values is not None:
        args += ["-f", str(values)]
    run(*args)


@pytest.mark.parametrize("values", VALUES, ids=ids)
def test_rendered_objects_fit_together(values: Path | None) -> None:
    docs = render(values)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    # the Services borrowers reach upstreams through (not the metrics Services)
    services = {
        s["metadata"]["name"]: s
        for s in by_kind["Service"]
        if "vacancyd.io/upstream" in s["metadata"]["labels"]
    }
    for svc in services.values():
        assert "selector" not in svc["spec"], "Services must be selector-less"
        assert [p["name"] for p in svc["spec"]["ports"]] == ["http"]
    raw = yaml.safe_load((CHART / "values.yaml").read_text())
    if values is not None:
        raw.update(yaml.safe_load(values.read_text()))
    if not raw["lenders"]:
        assert "Deployment" not in by_kind
        return
    (cm,) = by_kind["ConfigMap"]
    settings = parse_companion_config(cm["data"]["companion.toml"], "<rendered>")
    cluster = settings.kubernetes
    assert cluster.namespace == "vacancy"
    # every Service the companion will write EndpointSlices for exists, and only those
    expected = set()
    for up in raw["upstreams"]:
        expected.add(cluster.service_for(up["name"]))
        if cluster.direct_services:
            expected.add(cluster.service_for(up["name"]) + "-direct")
    assert expected == set(services)
    assert [lender.name for lender in settings.lender] == [x["name"] for x in raw["lenders"]]

    (deploy,) = by_kind["Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"][0] == "companion"
    sa = pod["serviceAccountName"]
    if raw.get("serviceAccount", {}).get("create", True):
        assert sa in {x["metadata"]["name"] for x in by_kind["ServiceAccount"]}

    (role,) = by_kind["Role"]
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "create", "patch", "delete"],
        }
    ]
    has_nodes = any(x.get("node") for x in raw["lenders"])
    node_rbac = raw.get("rbac", {}).get("nodeConditions", True)
    if has_nodes and node_rbac:
        (cr,) = by_kind["ClusterRole"]
        assert cr["rules"] == [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        ]
    else:
        assert "ClusterRole" not in by_kind


@pytest.mark.parametrize(
    "bad",
    [
        ["--set", "lenders[0].name=pc,lenders[0].url=ftp://pc"],
        ["--set", "upstreams[0].name=Chat,upstreams[0].port=80"],
        ["--set", "upstreams[0].name=chat,upstreams[0].port=0"],
        ["--set", "unknownKey=1"],
    ],
)
def test_values_schema_rejects_bad_values(bad: list[str]) -> None:
    proc = run(tool("helm"), "template", "vacancyd", str(CHART), *bad, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr


def test_prometheus_rule_is_the_rule_file() -> None:
    docs = render(CHART / "ci" / "scale-out-values.yaml")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "vacancyd.rules.yaml").read_text())


def test_manifests_are_the_rendered_chart(tmp_path: Path) -> None:
    tool("helm")
    work = tmp_path / "repo"
    shutil.copytree(ROOT / "charts", work / "charts")
    shutil.copytree(ROOT / "tools", work / "tools")
    (work / "manifests").mkdir()
    shutil.copy(ROOT / "manifests" / "values.yaml", work / "manifests" / "values.yaml")
    run("bash", str(work / "tools" / "render-manifests.sh"))
    for name in ("vacancyd.yaml", "prometheusrule.yaml"):
        assert (work / "manifests" / name).read_text() == (ROOT / "manifests" / name).read_text(), (
            f"manifests/{name} is stale: run tools/render-manifests.sh"
        )


def test_promtool_rule_unit_tests() -> None:
    promtool = tool("promtool")
    run(promtool, "check", "rules", str(CHART / "files" / "vacancyd.rules.yaml"))
    proc = run(promtool, "test", "rules", str(ROOT / "tests/alerts/vacancyd.rules.test.yaml"))
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_standard_override_keys_reach_the_objects() -> None:
    docs = render(CHART / "ci" / "standard-keys-values.yaml")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    # fullnameOverride replaces the whole prefix
    assert ("Service", "gpu-lenders-chat") in names
    assert ("Deployment", "gpu-lenders-companion") in names
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    template = deploy["spec"]["template"]
    pod = template["spec"]
    assert template["metadata"]["annotations"]["example.com/team"] == "inference"
    assert "checksum/config" in template["metadata"]["annotations"]
    assert template["metadata"]["labels"]["example.com/cost-center"] == "lab"
    # extra pod labels never leak into the selector, which must stay immutable across upgrades
    assert "example.com/cost-center" not in deploy["spec"]["selector"]["matchLabels"]
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod["priorityClassName"] == "lender-high"
    (container,) = pod["containers"]
    assert {"name": "TZ", "value": "UTC"} in container["env"]
    # the companion's config names the overridden Services
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    settings = parse_companion_config(cm["data"]["companion.toml"], "<rendered>")
    assert settings.kubernetes.service_for("chat") == "gpu-lenders-chat"


def test_name_override_replaces_the_chart_name() -> None:
    docs = render(None, "--set", "nameOverride=lend")
    (svc, *_rest) = [d for d in docs if d["kind"] == "Service"]
    assert svc["metadata"]["name"].startswith("vacancyd-lend-")
    assert svc["metadata"]["labels"]["app.kubernetes.io/name"] == "lend"


def test_service_monitors_scrape_companion_and_lenders() -> None:
    docs = render(CHART / "ci" / "standard-keys-values.yaml")
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"gpu-lenders-companion", "gpu-lenders-lender-metrics"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for monitor in monitors.values():
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        wanted = monitor["spec"]["selector"]["matchLabels"]
        matched = [
            name
            for name, svc in services.items()
            if wanted.items() <= svc["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, (monitor["metadata"]["name"], matched)
        (endpoint,) = monitor["spec"]["endpoints"]
        port_names = [p["name"] for p in services[matched[0]]["spec"]["ports"]]
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    lenders = monitors["gpu-lenders-lender-metrics"]["spec"]["endpoints"][0]
    assert lenders["authorization"]["credentials"] == {
        "name": "vacancyd-metrics-token",
        "key": "token",
    }
    (endpoints,) = [d for d in docs if d["kind"] == "Endpoints"]
    assert endpoints["metadata"]["name"] == "gpu-lenders-lender-metrics"
    got = [
        (s["addresses"][0]["ip"], s["addresses"][0]["hostname"], s["ports"][0]["port"])
        for s in endpoints["subsets"]
    ]
    # the port comes from each lender's url (https without one: 443); no address, no target
    assert got == [("192.0.2.31", "gaming-pc", 9470), ("192.0.2.32", "workstation", 443)]


def test_chart_works_as_a_subchart(tmp_path: Path) -> None:
    helm = tool("helm")
    parent = tmp_path / "platform"
    (parent / "charts").mkdir(parents=True)
    shutil.copytree(CHART, parent / "charts" / "vacancyd")
    (parent / "Chart.yaml").write_text(
        "apiVersion: v2\nname: platform\nversion: 1.0.0\n"
        "dependencies:\n  - name: vacancyd\n    version: 0.1.0\n    alias: lending\n"
    )
    (parent / "values.yaml").write_text(
        "global:\n  imageRegistry: registry.example\n  storageClass: fast\n"
        "lending:\n  lenders:\n    - name: pc\n      url: http://192.0.2.40:9470\n"
        "      address: 192.0.2.40\n"
    )
    run(helm, "lint", "--strict", str(parent))
    out = run(helm, "template", "rel", str(parent), "--namespace", "vacancy").stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Service", "Deployment", "ConfigMap"} <= kinds


def test_host_publishing_renders_its_own_least_privilege_rbac() -> None:
    docs = render(CHART / "ci" / "host-publishing-values.yaml")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    assert "Deployment" not in by_kind  # no lenders: no companion, and none of its RBAC
    (sa,) = by_kind["ServiceAccount"]
    name = sa["metadata"]["name"]
    assert name == "vacancyd-host-publisher"
    (secret,) = by_kind["Secret"]
    assert secret["type"] == "kubernetes.io/service-account-token"
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == name
    (role,) = by_kind["Role"]
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "create", "patch", "delete"],
        }
    ]
    (cr,) = by_kind["ClusterRole"]
    nodes = ["gaming-pc", "office-pc"]
    assert cr["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "resourceNames": nodes, "verbs": ["get"]},
        {
            "apiGroups": [""],
            "resources": ["nodes/status"],
            "resourceNames": nodes,
            "verbs": ["patch"],
        },
    ]
    for binding in (*by_kind["RoleBinding"], *by_kind["ClusterRoleBinding"]):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": name, "namespace": "vacancy"},
            {"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": "vacancyd-gaming-pc"},
        ]
    # "auto": no PrometheusRule where the API is absent, one where it is served
    assert "PrometheusRule" not in by_kind
    with_operator = render(
        CHART / "ci" / "host-publishing-values.yaml", "--api-versions", "monitoring.coreos.com/v1"
    )
    assert [d["kind"] for d in with_operator].count("PrometheusRule") == 1


def test_lender_ca_bundle_is_mounted_and_named_in_the_config(tmp_path: Path) -> None:
    docs = render(CHART / "ci" / "lender-ca-values.yaml")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    settings = parse_companion_config(cm["data"]["companion.toml"], "<rendered>")
    assert str(settings.ca_file) == "/var/run/vacancyd/ca/ca.crt"
    assert [(x.name, x.ca_file and str(x.ca_file)) for x in settings.lender] == [
        ("gaming-pc", None),
        ("studio", "/var/run/vacancyd/ca/studio.crt"),
    ]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["lender-ca"]["mountPath"] == "/var/run/vacancyd/ca"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["lender-ca"] == {
        "name": "lender-ca",
        "secret": {"secretName": "vacancyd-lender-ca"},
    }
    # from a ConfigMap instead
    docs = render(None, "--set", "lenders[0].name=pc,lenders[0].url=https://pc:9470")
    assert all("lender-ca" not in str(d) for d in docs)  # nothing without lenderCA
    values = yaml.safe_load((CHART / "ci" / "lender-ca-values.yaml").read_text())
    values["lenderCA"] = {"configMap": "lender-ca", "key": "ca.crt"}
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    docs = render(tmp_path / "values.yaml")
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["lender-ca"]["configMap"] == {"name": "lender-ca"}


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (["--set", "lenders[0].name=pc,lenders[0].url=https://pc,lenders[0].caKey=a.crt"], "caKey"),
        (["--set", "lenders[0].name=pc,lenders[0].url=https://pc,lenderCA.secret=s"], "needs key"),
        (
            [
                "--set",
                "lenders[0].name=pc,lenders[0].url=https://pc,lenderCA.secret=s,"
                "lenderCA.configMap=c,lenderCA.key=k",
            ],
            "lenderCA",
        ),
    ],
)
def test_lender_ca_values_are_checked(bad: list[str], why: str) -> None:
    proc = run(tool("helm"), "template", "vacancyd", str(CHART), *bad, check=False)
    assert proc.returncode != 0
    assert why in proc.stderr, proc.stderr


def test_the_chart_and_the_daemon_share_one_lendable_stable_default() -> None:
    """companion.lendableStableSeconds and lendable_stable_s have one default (10 s), so a
    companion from the chart and a host-side lender damp a return to lendable alike."""
    from vacancyd.config.model import ClusterSettings

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    default = ClusterSettings.model_fields["lendable_stable_s"].default
    assert values["companion"]["lendableStableSeconds"] == default == 10.0


def _by_component(docs: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return [
        d
        for d in docs
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
    ]


def _parses(args: list[str]) -> None:
    """The container's args are a command vacancyd's own CLI accepts."""
    from vacancyd.cli import build_parser

    parsed = build_parser().parse_args(args)
    assert parsed.func.__name__ == "cmd_k8s"


def test_the_uninstall_hook_runs_as_the_identities_that_wrote() -> None:
    companion = render(CHART / "ci" / "one-lender-values.yaml")
    (job,) = _by_component(companion, "cleanup")
    assert job["kind"] == "Job"
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = job["spec"]["template"]["spec"]
    sa = pod["serviceAccountName"]
    assert sa in {d["metadata"]["name"] for d in companion if d["kind"] == "ServiceAccount"}
    args = pod["containers"][0]["args"]
    assert args[:3] == ["k8s", "cleanup", "--namespace=vacancy"]
    lenders = yaml.safe_load((CHART / "ci" / "one-lender-values.yaml").read_text())["lenders"]
    assert sorted(a for a in args if a.startswith("--node=")) == sorted(
        f"--node={x['node']}" for x in lenders if x.get("node")
    )
    _parses(args)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    host = render(CHART / "ci" / "host-publishing-values.yaml")
    (job,) = _by_component(host, "cleanup")
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "vacancyd-host-publisher"
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--node=gaming-pc" in args and "--node=office-pc" in args
    _parses(args)

    off = render(
        CHART / "ci" / "one-lender-values.yaml", "--set", "cleanupOnUninstall.enabled=false"
    )
    assert _by_component(off, "cleanup") == []
    # the plain manifests have no hooks: applied with kubectl, the Job would run at once
    manifests = (ROOT / "manifests" / "vacancyd.yaml").read_text()
    assert "helm.sh/hook" not in manifests


def test_host_side_publishing_gets_the_stale_condition_check() -> None:
    host = render(CHART / "ci" / "host-publishing-values.yaml")
    (cron,) = _by_component(host, "stale-conditions")
    assert cron["kind"] == "CronJob" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "vacancyd-host-publisher"
    args = pod["containers"][0]["args"]
    assert args[:2] == ["k8s", "mark-stale"] and "--stale-after-s=180" in args
    assert "--node=gaming-pc" in args and "--node=office-pc" in args
    _parses(args)
    # its identity may get and patch exactly those Nodes
    (role,) = [d for d in host if d["kind"] == "ClusterRole"]
    for rule in role["rules"]:
        assert rule["resourceNames"] == ["gaming-pc", "office-pc"]
    # for the companion's lenders, as the companion (a companion whose Pod is gone)
    companion = render(CHART / "ci" / "one-lender-values.yaml")
    (cron,) = _by_component(companion, "stale-conditions")
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "vacancyd-companion"
    assert "--node=gaming-pc" in pod["containers"][0]["args"]
    off = render(
        CHART / "ci" / "host-publishing-values.yaml", "--set", "staleConditions.enabled=false"
    )
    assert _by_component(off, "stale-conditions") == []
    # a staleness limit the heartbeats cannot beat is refused at render time
    helm = [tool("helm"), "template", "vacancyd", str(CHART), "-f"]
    proc = run(
        *helm, str(CHART / "ci" / "one-lender-values.yaml"),
        "--set", "staleConditions.staleAfterSeconds=100", check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "more than twice companion.heartbeatSeconds" in proc.stderr


POD_SETTINGS = {
    "image": {"repository": "registry.example/vacancyd", "tag": "9.9.9"},
    "resources": {"requests": {"cpu": "50m", "memory": "80Mi"}, "limits": {"memory": "512Mi"}},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}
                ]
            }
        }
    },
}


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The pod spec of every workload the chart renders, by kind and name."""
    out = {}
    for d in docs:
        spec = d.get("spec", {})
        if d["kind"] == "Deployment":
            out[f"Deployment/{d['metadata']['name']}"] = spec["template"]["spec"]
        elif d["kind"] == "CronJob":
            out[f"CronJob/{d['metadata']['name']}"] = spec["jobTemplate"]["spec"]["template"][
                "spec"
            ]
        elif d["kind"] == "Job":
            out[f"Job/{d['metadata']['name']}"] = spec["template"]["spec"]
    return out


def render_notes(tmp_path: Path, *values: Path) -> str:
    """NOTES.txt as ``helm install`` would print it, rendered offline: ``helm install
    --dry-run`` needs a cluster, so a scratch copy of the chart renders the same file through
    ``tpl`` into a ConfigMap (with the chart's own helpers)."""
    scratch = tmp_path / "notes-chart"
    shutil.copytree(CHART, scratch)
    shutil.copy(scratch / "templates" / "NOTES.txt", scratch / "files" / "notes.txt")
    (scratch / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: {{ tpl (.Files.Get "files/notes.txt") . | quote }}\n'
    )
    args = [tool("helm"), "template", "vacancyd", str(scratch), "--show-only"]
    args += ["templates/zz-notes.yaml"]
    for v in values:
        args += ["-f", str(v)]
    (doc,) = [d for d in yaml.safe_load_all(run(*args).stdout) if d]
    return str(doc["data"]["notes"])


@pytest.mark.parametrize("where", ["top", "companion"])
def test_pod_settings_are_top_level_and_the_old_companion_keys_still_apply(
    tmp_path: Path, where: str
) -> None:
    """One values layout: image, resources, nodeSelector, tolerations and affinity sit at the
    top level with the other pod keys; set under companion. (the old layout) they still reach
    every Pod, and the install notes say to move them."""
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(POD_SETTINGS if where == "top" else {"companion": POD_SETTINGS})
    )
    docs = render(CHART / "ci" / "one-lender-values.yaml", "-f", str(values))
    pods = _pods(docs)
    assert {k.split("/")[0] for k in pods} == {"Deployment", "CronJob", "Job"}, sorted(pods)
    for name, pod in pods.items():
        (container,) = pod["containers"]
        assert container["image"] == "registry.example/vacancyd:9.9.9", name
        assert container["resources"] == POD_SETTINGS["resources"], name
        assert pod["nodeSelector"] == POD_SETTINGS["nodeSelector"], name
        assert pod["tolerations"] == POD_SETTINGS["tolerations"], name
    (deploy,) = [p for k, p in pods.items() if k.startswith("Deployment/")]
    assert deploy["affinity"] == POD_SETTINGS["affinity"]
    notes = render_notes(tmp_path, CHART / "ci" / "one-lender-values.yaml", values)
    if where == "companion":
        assert "DEPRECATED values: companion.image, companion.resources" in notes
        assert "companion.image.tag -> image.tag" in notes
    else:
        assert "DEPRECATED" not in notes


def test_an_old_partial_image_override_keeps_the_default_repository() -> None:
    docs = render(CHART / "ci" / "one-lender-values.yaml", "--set", "companion.image.tag=1.2.3")
    (deploy,) = [p for k, p in _pods(docs).items() if k.startswith("Deployment/")]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert deploy["containers"][0]["image"] == f"{values['image']['repository']}:1.2.3"
    assert "image" not in values["companion"]  # the defaults live at the top level only
