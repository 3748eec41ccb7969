"""vacancyd.web.catalogue: one table declares every metric; what a scrape shows and what
the docs, dashboards and alert rules name agree with it."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from hypothesis import given, settings
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from tests.support.status_docs import documents
from vacancyd.api.metrics import render_gauges
from vacancyd.core.status import StatusDocument
from vacancyd.k8s.companion import CompanionCollector
from vacancyd.web.catalogue import CATALOGUE, METRICS, MetricSpec, MetricType
from vacancyd.web.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
#: The series names each type adds to its registered name in the exposition.
SUFFIXES = {
    MetricType.GAUGE: ("",),
    MetricType.COUNTER: ("", "_total", "_created"),
    MetricType.HISTOGRAM: ("", "_bucket", "_sum", "_count", "_created"),
    MetricType.INFO: ("", "_info"),
}


def check_exposition(registry: CollectorRegistry) -> set[str]:
    """Every vacancyd_* family of a scrape of ``registry`` is declared with the same type,
    help text and label names; returns the declared names seen."""
    seen = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if not family.name.startswith("vacancyd_"):
            continue
        name = (
            family.name.removesuffix("_info")
            if family.name == "vacancyd_build_info"
            else family.name
        )
        spec = METRICS[name]
        expected = "gauge" if spec.type is MetricType.INFO else spec.type.value
        assert (family.type, family.documentation) == (expected, spec.help), name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} <= set(spec.labels) or spec.type is MetricType.INFO
        seen.add(name)
    return seen


class OneDocument(Collector):
    def __init__(self, doc: StatusDocument) -> None:
        self.doc = doc

    def collect(self) -> Iterable[Metric]:
        return render_gauges(self.doc)


@settings(max_examples=60, deadline=None)
@given(documents)
def test_every_lender_gauge_is_rendered_as_declared(doc: StatusDocument) -> None:
    registry = CollectorRegistry()
    registry.register(OneDocument(doc))
    check_exposition(registry)


def test_the_listeners_counters_are_registered_as_declared() -> None:
    seen = check_exposition(Metrics().registry)
    assert {"vacancyd_jobs", "vacancyd_request_duration_seconds", "vacancyd_build"} <= seen


def test_the_companions_gauges_are_registered_as_declared() -> None:
    registry = CollectorRegistry()
    registry.register(CompanionCollector([]))
    assert check_exposition(registry) == {
        "vacancyd_companion_lender_up",
        "vacancyd_companion_kubernetes_writes_ok",
        "vacancyd_companion_upstream_lendable",
    }


def test_every_metric_the_docs_dashboards_and_alerts_name_is_declared() -> None:
    series = {spec.name + suffix: spec for spec in CATALOGUE for suffix in SUFFIXES[spec.type]}
    places = [
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
        ROOT / "ARCHITECTURE.md",
        *ROOT.glob("dashboards/*"),
        *ROOT.glob("manifests/*.yaml"),
        *ROOT.glob("charts/**/*.yaml"),
        *ROOT.glob("tests/alerts/*"),
    ]
    unknown = []
    named = 0
    for path in places:
        if not path.is_file():
            continue
        for word in re.findall(r"\bvacancyd_[a-z0-9_]+", path.read_text(encoding="utf-8")):
            named += 1
            if word.endswith("_"):  # a family of names: vacancyd_companion_*
                known = any(s.startswith(word) for s in series)
            else:
                known = word in series
            if not known:
                unknown.append(f"{path.relative_to(ROOT)}: {word}")
    assert named > 50  # the places above do name metrics
    assert not unknown, unknown


def test_names_are_unique_and_follow_the_conventions() -> None:
    assert len(METRICS) == len(CATALOGUE)
    for spec in CATALOGUE:
        assert isinstance(spec, MetricSpec) and spec.help.endswith(".")
        assert re.fullmatch(r"vacancyd_[a-z0-9_]+", spec.name), spec.name
        assert not spec.name.endswith("_total"), spec.name  # the exposition adds it
