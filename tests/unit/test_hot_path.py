"""The request path's remembered answers agree with what they remember: classification,
rendered refusals, loop-owned counters and histograms, the presence view, gate step 1 from
the switches, and the event-loop choice."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from vacancyd.adapters import ADAPTERS
from vacancyd.core import gate
from vacancyd.core.classify import Classifier, RouteClass, classify
from vacancyd.core.policy import ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.core.reasons import Credit, Reason, Refresh, Refuse
from vacancyd.core.refusal import render_refusal, render_refusal_bytes
from vacancyd.runtime import eventloop
from vacancyd.state import PresenceReading, SharedState
from vacancyd.web.metrics import LoopCounter, LoopHistogram, Metrics

PATHS = [
    ("POST", "/v1/chat/completions", ""),
    ("GET", "/v1/models", ""),
    ("HEAD", "/v1/models", ""),
    ("GET", "/v1/./models", ""),
    ("GET", "/v1/%2e%2e/admin", ""),
    ("DELETE", "/v1/models", ""),
    ("GET", "/nope", "a=1"),
    ("GET", "relative", ""),
]


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_classifier_answers_as_classify_does(adapter: str) -> None:
    table = ADAPTERS[adapter].table
    classifier = Classifier(table)
    for method, path, query in PATHS * 2:  # the second round is answered from memory
        assert classifier(method, path, query) == classify(method, path, query, table)


def test_classifier_keys_on_whether_a_query_is_present() -> None:
    """A ``no_query`` route is management once a query is added; the memory must not mix
    the two answers up."""
    table = ADAPTERS["openai"].table
    classifier = Classifier(table)
    plain = classifier("GET", "/health", "")
    with_query = classifier("GET", "/health", "verbose=1")
    assert plain == classify("GET", "/health", "", table)
    assert plain.klass is RouteClass.PASSTHROUGH
    assert with_query.klass is RouteClass.MANAGEMENT
    assert classifier("GET", "/health", "") is plain


def test_classifier_memory_is_bounded() -> None:
    table = ADAPTERS["openai"].table
    classifier = Classifier(table, max_entries=8)
    for i in range(100):
        classifier("GET", f"/v1/models/m{i}", "")
    assert len(classifier._seen) == 8
    assert classifier("GET", "/v1/models/m0", "") == classify("GET", "/v1/models/m0", "", table)


@pytest.mark.parametrize(
    "refusal",
    [
        Refuse.of(Reason.LENDING_DISABLED, "lending is switched off on this host"),
        Refuse.of(Reason.RESOURCE_BUSY, "busy", resource="ram", refresh=Refresh.CAPACITY),
        Refuse.of(
            Reason.INSUFFICIENT_CAPACITY,
            "not enough",
            resource="gpu0",
            credit=Credit(False, "the server is processing other work"),
        ),
        Refuse.of(Reason.OWNER_ACTIVE, "the owner is using this machine", retry_after_s=120),
        Refuse.of(Reason.OWNER_ACTIVE, "paused", extra={"hold": "pause", "until": 1.8e9}),
    ],
)
def test_rendered_refusal_is_the_rendered_envelope(refusal: Refuse) -> None:
    status, headers, body = render_refusal(refusal, "up", 429)
    rendered = render_refusal_bytes(refusal, "up", 429)
    assert rendered.status == status == 429
    assert json.loads(rendered.body) == body
    assert rendered.headers == {**headers, "Content-Type": "application/json; charset=utf-8"}
    assert render_refusal_bytes(refusal, "up", 429) is rendered  # remembered
    assert render_refusal_bytes(refusal, "other", 429).body != rendered.body


def test_a_refresh_hint_is_not_on_the_wire() -> None:
    hinted = Refuse.of(Reason.RESOURCE_BUSY, "busy", resource="ram", refresh=Refresh.CAPACITY)
    plain = Refuse.of(Reason.RESOURCE_BUSY, "busy", resource="ram")
    assert render_refusal_bytes(hinted, "up") == render_refusal_bytes(plain, "up")
    assert "refresh" not in json.loads(render_refusal_bytes(hinted, "up").body)["error"]


def test_rendered_refusal_counts_every_field() -> None:
    """Two refusals that differ only in ``extra`` render differently when the body shows it,
    and an unhashable ``extra`` value is rendered without being remembered."""
    paused = Refuse.of(Reason.OWNER_ACTIVE, "held", extra={"hold": "pause"})
    away = Refuse.of(Reason.OWNER_ACTIVE, "held", extra={"hold": "away"})
    assert json.loads(render_refusal_bytes(paused, "up").body)["error"]["hold"] == "pause"
    assert json.loads(render_refusal_bytes(away, "up").body)["error"]["hold"] == "away"
    odd = Refuse.of(Reason.OWNER_ACTIVE, "held", extra={"hold": "pause", "why": ["a", "b"]})
    assert json.loads(render_refusal_bytes(odd, "up").body) == render_refusal(odd, "up")[2]


def test_rendered_refusal_tells_sdks_not_to_retry_past_their_limit() -> None:
    rendered = render_refusal_bytes(Refuse.of(Reason.LENDING_DISABLED, "off"), "up")
    assert rendered.headers["Retry-After"] == "300"
    assert rendered.headers["x-should-retry"] == "false"


def test_loop_counter_exposes_what_a_prometheus_counter_would() -> None:
    ours, theirs = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
    Metrics()  # disables the *_created series, as the daemon runs
    mine = LoopCounter("vacancyd_test_requests", "Requests.", ("upstream", "code"))
    ours.register(mine)
    reference = Counter(
        "vacancyd_test_requests", "Requests.", ["upstream", "code"], registry=theirs
    )
    for labels in [("up", "200"), ("up", "503"), ("up", "503"), ('we"ird', "200")]:
        mine.inc(*labels)
        reference.labels(*labels).inc()
    assert generate_latest(ours) == generate_latest(theirs)
    assert mine.value("up", "503") == 2
    assert mine.value("up", "404") == 0


def test_loop_histogram_exposes_what_a_prometheus_histogram_would() -> None:
    ours, theirs = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
    Metrics()  # disables the *_created series, as the daemon runs
    buckets = (0.005, 0.1, 1, 60)
    mine = LoopHistogram("vacancyd_test_seconds", "Durations.", ("upstream", "klass"), buckets)
    ours.register(mine)
    reference = Histogram(
        "vacancyd_test_seconds",
        "Durations.",
        ["upstream", "klass"],
        buckets=buckets,
        registry=theirs,
    )
    observed = [("up", "work", v) for v in (0.0, 0.004, 0.005, 0.0051, 0.1, 3.0, 60.0, 61.0)]
    observed += [("up", "passthrough", 0.2), ('we"ird', "work", 1e9)]
    for upstream, klass, value in observed:
        mine.labels(upstream, klass).observe(value)
        reference.labels(upstream, klass).observe(value)
    assert generate_latest(ours) == generate_latest(theirs)
    assert b'vacancyd_test_seconds_bucket{klass="work",le="0.005",upstream="up"} 3.0' in (
        generate_latest(ours)
    )


def test_event_loop_choice() -> None:
    assert eventloop.loop_factory("asyncio") == ("asyncio", None)
    with pytest.raises(eventloop.EventLoopError, match="unknown event loop 'tokio'"):
        eventloop.loop_factory("tokio")
    name, _ = eventloop.loop_factory("auto")
    assert name == ("uvloop" if eventloop.uvloop_available() else "asyncio")


def test_event_loop_runs_the_coroutine_on_the_chosen_loop() -> None:
    async def loop_kind() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert eventloop.run(loop_kind(), "asyncio").startswith("asyncio")
    if eventloop.uvloop_available():
        assert eventloop.run(loop_kind(), "uvloop").startswith("uvloop")


def test_event_loop_refuses_a_missing_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_uvloop(name: str, *args: object, **kwargs: object) -> object:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    assert eventloop.loop_factory("auto") == ("asyncio", None)
    with pytest.raises(eventloop.EventLoopError, match="cannot be imported"):
        eventloop.loop_factory("uvloop")


def test_gate_step_one_from_the_switches_alone() -> None:
    stopping = gate.decide_switches(True, True)
    off = gate.decide_switches(False, False)
    # a draining lender says so in its own reason code, with a short Retry-After
    assert stopping is not None and stopping.reason is Reason.SHUTTING_DOWN
    assert "shutting down" in stopping.detail
    assert stopping.retry_after_s == 10
    assert off is not None and off.reason is Reason.LENDING_DISABLED
    assert off.retry_after_s == 300
    assert gate.decide_switches(False, True) is None


def test_presence_view_is_kept_only_while_its_inputs_stay() -> None:
    state = SharedState(
        {"ram": ResourcePolicy("ram", ResourceKind.MEMORY)},
        {"up": UpstreamPolicy("up", "openai", "ram")},
        presence_source="logind",
        release_after_s=10.0,
        clock=lambda: 0.0,
    )
    never = state.presence_view(0.0)
    assert not never.sampled
    assert state.presence_view(5.0) is never  # time alone changes nothing in the view
    state.record_presence(PresenceReading(owner_signal=False, evidence_complete=True), 1.0)
    away = state.presence_view(1.0)
    assert away.sampled and away.observed_at == 1.0 and not away.veto_active
    state.record_presence(PresenceReading(owner_signal=True, evidence_complete=True), 2.0)
    present = state.presence_view(2.0)
    assert present.veto_active and present.observed_at == 2.0
    state.record_presence_failure("bus gone", 3.0)
    failed = state.presence_view(3.0)
    assert not failed.evidence_complete and "bus gone" in failed.detail
    assert state.presence_view(3.5) is failed
