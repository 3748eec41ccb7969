"""dashboards/vacancyd.json and the alert rules only name metrics a real scrape exposes.

The scrape comes from a real daemon (a GPU under the fake NVML with pressure, a llama-server
look-alike answering ``/slots``, host-side Kubernetes publishing to the in-memory fake API)
after it has admitted, refused and reclaimed work, plus a real companion following it: the
union of what their ``/metrics`` endpoints serve. Any metric name a query or rule uses that
is missing from it is a broken panel or an alert that can never fire.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.config import companion_toml, daemon_toml, gpu, lender, token, upstream
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.fake_kube import FakeKube
from tests.support.gpu import Scenario
from vacancyd.config.load import parse_companion_config
from vacancyd.k8s.companion import Companion

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "vacancyd.json"
RULE_FILES = [
    ROOT / "charts/vacancyd/files/vacancyd.rules.yaml",
    ROOT / "manifests/prometheusrule.yaml",
]
#: Series names we own or rely on: ours, and the standard process collector's.
NAME = re.compile(r"\b((?:vacancyd|process|python)_[a-zA-Z0-9_]+)\b")
READ = "r" * 24

SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "info": ("_info",),
    "gauge": ("",),
    "unknown": ("",),
}


def exposed_names(text: str) -> set[str]:
    """Every series name a scrape can carry, including declared families without samples."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    queries: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    queries.append(value)
                elif key == "query" and isinstance(value, dict | str):
                    queries.append(json.dumps(value) if isinstance(value, dict) else value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(doc)
    return [q for q in queries if q != "prometheus"]  # the datasource variable's type


def rule_exprs() -> list[str]:
    exprs: list[str] = []
    for path in RULE_FILES:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = doc.get("spec", doc) if isinstance(doc, dict) else {}
            for group in spec.get("groups", []):
                exprs.extend(str(rule["expr"]) for rule in group["rules"])
    return exprs


def lender_config(target: str, state_dir: Path) -> str:
    """A llama-server lender on the fake card 0 that publishes its node's conditions."""
    return daemon_toml(
        upstream("chat", target, adapter="llamacpp", resource="gpu0"),
        resources=(gpu("gpu0", 0, pressure={"poll_ms": 100, "fixed_threshold": 0.2}),),
        tokens=(token("reader", READ, "read"),),
        collectors={"poll_s": 0.2},
        state_dir=state_dir,
        kubernetes={"node": "pc", "address": "192.0.2.10", "namespace": "vacancy"},
    )


def companion_config(url: str) -> str:
    return companion_toml(
        lender("pc", url, READ, "192.0.2.10", node="pc"), kubernetes={"namespace": "vacancy"}
    )


@pytest.fixture
async def scrape(nvml: Scenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    kube = FakeKube()
    kube.add_node("pc")
    monkeypatch.setattr("vacancyd.k8s.host._connect", lambda _settings: kube.connect)
    app, _ = openai_like_app()
    async with serve_app(app) as target:
        async with running_daemon(lender_config(target, tmp_path / "state")) as d:
            await d.wait_ready(timeout_s=15)
            async with aiohttp.ClientSession() as http:
                chat = f"{d.proxy_url('chat')}/v1/chat/completions"
                body = {"model": "tiny", "messages": []}
                async with http.post(chat, json=body) as resp:
                    assert resp.status == 200
                d.state.set_lending(False)
                async with http.post(chat, json=body) as resp:
                    assert resp.status == 503
                d.state.set_lending(True)
                async with http.post(f"{d.api_url}/admin/reclaim", json={}) as resp:
                    assert resp.status in (200, 202)
                companion = Companion(
                    parse_companion_config(companion_config(d.api_url), "<test>"),
                    connect=kube.connect,
                )
                await companion.start()
                try:
                    async with asyncio.timeout(10):
                        while True:
                            async with http.get(f"http://{companion.address}/metrics") as resp:
                                companion_text = await resp.text()
                            if 'vacancyd_companion_lender_up{lender="pc"} 1.0' in companion_text:
                                break
                            await asyncio.sleep(0.05)
                finally:
                    await companion.stop()
                async with http.get(f"{d.api_url}/metrics") as resp:
                    assert resp.status == 200
                    lender_text = await resp.text()
    return exposed_names(lender_text) | exposed_names(companion_text)


def test_dashboard_and_rules_name_only_exposed_metrics(scrape: set[str]) -> None:
    queries = dashboard_queries()
    assert len(queries) > 20
    used = {(name, where) for where in queries + rule_exprs() for name in NAME.findall(where)}
    missing = sorted({name for name, _ in used if name not in scrape})
    assert missing == [], f"not in a real /metrics scrape: {missing}"
    # the panels the dashboard promises
    text = DASHBOARD.read_text()
    for metric in (
        "vacancyd_upstream_lendable",
        "vacancyd_admission_decisions_total",
        "vacancyd_active_work",
        "vacancyd_owner_veto_active",
        "vacancyd_resource_free_bytes",
        "vacancyd_gpu_owner_load_ratio",
        "vacancyd_request_duration_seconds_bucket",
        "vacancyd_server_observation_age_seconds",
        # the Borrowers row (issue 23)
        "vacancyd_borrower_requests_total",
        "vacancyd_borrower_busy_seconds_total",
        "vacancyd_borrower_tokens_total",
        "vacancyd_borrower_energy_joules_total",
    ):
        assert metric in text, metric
    # and the series this issue added are really served
    for name in (
        "vacancyd_build_info",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "vacancyd_request_duration_seconds_bucket",
        "vacancyd_server_observation_quality",
        "vacancyd_server_observation_age_seconds",
        "vacancyd_server_idle",
    ):
        assert name in scrape, name
