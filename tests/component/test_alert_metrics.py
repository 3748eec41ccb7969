"""Every metric an alert rule reads exists: the names in charts/vacancyd/files/
vacancyd.rules.yaml checked against real /metrics scrapes of a lender (with host-side
publishing, so its Kubernetes gauge is there) and of the companion."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import config as cfg
from tests.support.daemon import openai_like_app, running_daemon, serve_app
from tests.support.fake_kube import FakeKube
from tests.support.k8s_lender import READ, lender_toml
from vacancyd.config.load import parse_companion_config
from vacancyd.k8s.companion import Companion

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "vacancyd" / "files" / "vacancyd.rules.yaml"
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_count", "_sum", "_bucket", "_created"),
    "summary": ("_count", "_sum", "_created"),
}


def rule_metrics() -> set[str]:
    doc = yaml.safe_load(RULES.read_text())
    names: set[str] = set()
    for group in doc["groups"]:
        for rule in group["rules"]:
            names |= set(re.findall(r"\b(vacancyd_[a-z0-9_]+)\b", rule["expr"]))
    return names


def exported(text: str) -> set[str]:
    """Every sample name the scrape's metric families can carry (a labelled counter with no
    samples yet still declares its family)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


async def scrape(url: str, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=headers) as resp:
            assert resp.status == 200
            return await resp.text()


async def test_every_metric_in_every_rule_is_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    wanted = rule_metrics()
    assert {"vacancyd_ready", "vacancyd_companion_lender_up"} <= wanted
    kube = FakeKube()
    kube.add_node("pc")
    monkeypatch.setattr("vacancyd.k8s.host._connect", lambda _settings: kube.connect)
    section = {"node": "pc", "address": "192.0.2.10", "namespace": "vacancy"}
    app, _ = openai_like_app()
    async with (
        serve_app(app) as target,
        running_daemon(lender_toml(target, kubernetes=section)) as d,
    ):
        await d.wait_ready()
        lender = await scrape(f"{d.api_url}/metrics", READ)
        toml = cfg.companion_toml(
            cfg.lender("pc", d.api_url, READ, "192.0.2.10"), kubernetes={"namespace": "vacancy"}
        )
        companion = Companion(parse_companion_config(toml, "<test>"), connect=kube.connect)
        await companion.start()
        try:
            side = await scrape(f"http://{companion.address}/metrics")
        finally:
            await companion.stop()
    missing = wanted - exported(lender) - exported(side)
    assert not missing, f"alert rules read metrics nothing exports: {sorted(missing)}"
