"""The alert rules' own hygiene: every rule, in the chart's rule file and in the rendered
PrometheusRule, waits (``for:``) at least two of the chart's scrape intervals, so that one
odd scrape (a counter reset, a lender that just restarted) never pages anyone. The promtool
unit tests in tests/alerts check what each rule fires on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_RULES = ROOT / "charts" / "vacancyd" / "files" / "vacancyd.rules.yaml"
RENDERED = ROOT / "manifests" / "prometheusrule.yaml"
VALUES = ROOT / "charts" / "vacancyd" / "values.yaml"
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")


def seconds(duration: str) -> float:
    """A Prometheus duration (``90s``, ``1h30m``) in seconds. Raises ValueError otherwise."""
    parts = _DURATION.findall(duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def rules(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    groups = [g for d in docs for g in (d.get("spec", d)["groups"])]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def scrape_interval_s() -> float:
    """The longest scrape interval the chart's ServiceMonitors use."""
    values = yaml.safe_load(VALUES.read_text())
    return max(seconds(values[k]["interval"]) for k in ("serviceMonitor", "lenderMetrics"))


def test_duration_parser() -> None:
    assert seconds("2m") == 120 and seconds("1h30m") == 5400 and seconds("30s") == 30
    with pytest.raises(ValueError):
        seconds("2 minutes")


@pytest.mark.parametrize("path", [CHART_RULES, RENDERED], ids=lambda p: p.name)
def test_every_alert_waits_two_scrape_intervals(path: Path) -> None:
    found = rules(path)
    assert len(found) >= 10  # the whole file was read, not an empty group
    least = 2 * scrape_interval_s()
    short = {
        r["alert"]: r.get("for", "none")
        for r in found
        if "for" not in r or seconds(str(r["for"])) < least
    }
    assert not short, f"alerts without a for: of at least {least:g} s: {short}"


def test_the_rendered_rule_matches_the_chart_file() -> None:
    """manifests/prometheusrule.yaml is rendered from the chart: the same alerts, the same
    waits (a hand edit of one without the other fails here)."""
    chart = {r["alert"]: (r["expr"].split(), r.get("for")) for r in rules(CHART_RULES)}
    rendered = {r["alert"]: (r["expr"].split(), r.get("for")) for r in rules(RENDERED)}
    assert chart == rendered


RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://github.com/vacancyd/vacancyd/blob/main/docs/runbooks.md#"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, spaces to dashes, no punctuation."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", [CHART_RULES, RENDERED], ids=lambda p: p.name)
def test_every_alert_links_its_runbook_section(path: Path) -> None:
    headings = re.findall(r"^## (.+)$", RUNBOOKS.read_text(encoding="utf-8"), flags=re.M)
    anchors = {_anchor(h) for h in headings}
    found = rules(path)
    assert len(found) >= 10
    for rule in found:
        url = rule.get("annotations", {}).get("runbook_url", "")
        assert url.startswith(RUNBOOK_BASE), (rule["alert"], url)
        anchor = url.removeprefix(RUNBOOK_BASE)
        assert anchor in anchors, f"{rule['alert']}: docs/runbooks.md has no section #{anchor}"
        assert anchor == _anchor(rule["alert"])
    assert len(headings) == len({r["alert"] for r in found})  # no runbook for a rule not there
