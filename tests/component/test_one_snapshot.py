"""One status document, three renderings: ``/status`` (its JSON), ``/metrics`` (the lender's
gauges) and what the Kubernetes publisher writes (Node conditions, EndpointSlice readiness
and annotations) agree for the same document, sharing, waiting, the owner's holds and the
publisher's own health included; the host-side publisher and an in-cluster companion
reading ``GET /status`` over HTTP publish the same state.

The daemon is built as ``vacancyd run`` builds it (without binding its listeners); the
state it renders is set the way its writers set it: capacity and presence readings, a job
on an exclusive upstream, one in a two-slot upstream with requests waiting, an owner's hold
on one resource, a listener that is not bound, and a host-side publisher whose API client
cannot connect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from tests.support.config import RAM, companion_toml, daemon_toml, lender, resource, upstream
from tests.support.daemon import serve_app
from vacancyd.api.app import make_api
from vacancyd.api.metrics import render_gauges
from vacancyd.api.status import StatusViews, read_status
from vacancyd.config import parse_config
from vacancyd.config.load import parse_companion_config
from vacancyd.core import conditions
from vacancyd.core.conditions import Status
from vacancyd.core.holds import Hold, HoldKind
from vacancyd.core.ledger import Job
from vacancyd.core.observations import CapacityReading
from vacancyd.core.status import StatusDocument
from vacancyd.k8s.api import K8sApiError, KubeApi
from vacancyd.k8s.companion import make_followers
from vacancyd.k8s.host import HostPublisher
from vacancyd.runtime.daemon import Daemon
from vacancyd.state import PresenceReading
from vacancyd.web.auth import Authenticator

T0 = 1_000.0
MIB = 1024 * 1024


def settings_toml(tmp_path: Path) -> str:
    target = "http://127.0.0.1:9"
    return f'state_dir = "{tmp_path}"\n' + daemon_toml(
        # a and b share "ram" and a excludes b; c has two slots and a wait queue on "vram"
        upstream("a", target, exclusive_of=["b"]),
        upstream("b", target),
        upstream("c", target, resource="vram", max_concurrent=2, busy="wait"),
        resources=(RAM, resource("vram")),
        owner={"release_after_s": 0},
        extra='[kubernetes]\nnamespace = "vacancyd"\nnode = "pc"\naddress = "192.168.1.20"\n',
    )


class OneDocument(Collector):
    """Serves the gauges of one given document, as ``StateCollector`` serves a fresh one."""

    def __init__(self, doc: StatusDocument) -> None:
        self._doc = doc

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from render_gauges(self._doc)


def scrape(doc: StatusDocument) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The exposition text of ``doc``'s gauges, parsed back: (name, labels) -> value."""
    registry = CollectorRegistry()
    registry.register(OneDocument(doc))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def never_connects() -> KubeApi:
    raise K8sApiError("connect", 403, "forbidden: the service account cannot get nodes")


async def companion_view(daemon: Daemon, views: StatusViews) -> conditions.LenderState:
    """What an in-cluster companion follower reads from this daemon's ``GET /status``,
    served by the daemon's own API application on a real socket."""
    state = daemon.state
    auth = Authenticator([], trust_loopback=True, metrics=daemon.metrics)
    api = make_api(
        state,
        auth,
        daemon.metrics,
        started_at=T0,
        release=daemon.work.admin_release,
        reclaim=daemon.reclaimer.reclaim,
        views=views,
    )
    async with serve_app(api) as url, aiohttp.ClientSession() as session:
        toml = companion_toml(
            lender("pc", url, "r" * 24, "192.0.2.10", node="pc"),
            kubernetes={"namespace": "vacancyd"},
        )
        (follower,) = make_followers(
            parse_companion_config(toml, "<test>"), session, never_connects
        )
        await follower.read_status()
        assert follower.last_seen is not None, "the follower could not read /status"
        return follower.lender


async def test_status_metrics_and_the_publisher_agree_for_one_document(tmp_path: Path) -> None:
    settings = parse_config(settings_toml(tmp_path), "<test>")
    daemon = Daemon(settings)
    state = daemon.state
    now = T0
    state.clock = lambda: now
    assert settings.kubernetes is not None
    host = HostPublisher(
        settings.kubernetes, state, lambda: read_status(state, T0, views), connect=never_connects
    )
    # what the daemon hands every status reader, with this publisher's health
    views = replace(daemon.views, kubernetes=host.status)
    # The publisher's client fails: its health must show on all three renderings.
    task = asyncio.get_running_loop().create_task(host.publisher.run(), name="publisher")
    try:
        async with asyncio.timeout(5):
            while host.publisher.healthy:  # noqa: ASYNC110 - polls the publisher's health
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    state.record_presence(PresenceReading(owner_signal=False, evidence_complete=True), now)
    state.record_capacity("ram", CapacityReading(free_mib=12_000, total_mib=16_000), now)
    state.record_capacity("vram", CapacityReading(free_mib=6_000, total_mib=8_000), now)
    for name, port in (("a", 8001), ("b", 8002), ("c", 8003)):
        state.set_listener(name, f"127.0.0.1:{port}", bound=name != "b")
    assert isinstance(state.ledger.reserve("a", ("ram",), now), Job)
    assert isinstance(state.ledger.reserve("c", ("vram",), now), Job)
    state.ledger.waiting["c"] = 3
    state.holds = (
        Hold(HoldKind.EXCLUSIVE_APP, "the owner's game runs", frozenset({"vram"}), None, None),
    )

    doc = read_status(state, T0, views)
    status = doc.to_json()
    metrics = scrape(doc)
    lender = conditions.lender_from_status(status)

    def gauge(name: str, **labels: str) -> float | None:
        return metrics.get((name, tuple(sorted(labels.items()))))

    # What the scenario is: a and b on the shared card (a holds it exclusively, b is not
    # bound), c refused by the owner's hold on its resource while its slot has a job and
    # three requests wait.
    assert status["upstreams"]["a"]["lendable"] is True
    assert status["upstreams"]["c"]["refusal"]["reason"] == "owner_active"
    assert status["resources"]["ram"]["card"] == "exclusive"
    assert status["upstreams"]["b"]["busy"] is True
    assert status["kubernetes"]["writes_ok"] is False

    # The host-side publisher reads this state exactly as the companion does over HTTP.
    assert host.lender() == lender
    companion = await companion_view(daemon, views)
    assert companion == lender

    # Upstreams: lendable, bound, headroom, jobs and waiters.
    slices = {
        s["metadata"]["labels"][conditions.UPSTREAM_LABEL]: s
        for s in host.publisher.desired_slices(lender)
        if not s["metadata"]["labels"][conditions.SERVICE_NAME_LABEL].endswith("-direct")
    }
    for name, up in status["upstreams"].items():
        lendable = up["lendable"]
        bound = up["listener"]["bound"]
        assert gauge("vacancyd_upstream_lendable", upstream=name) == float(lendable)
        assert gauge("vacancyd_listener_up", upstream=name) == float(bound)
        endpoint = slices[name]["endpoints"][0]["conditions"]
        assert endpoint["ready"] is (lendable and bound), name
        headroom = up["headroom"]["lendable_mib"]
        assert gauge("vacancyd_upstream_headroom_bytes", upstream=name) == headroom * MIB
        annotations = slices[name]["metadata"].get("annotations", {})
        assert annotations.get(conditions.HEADROOM_ANNOTATION) == str(
            conditions.quantize_mib(headroom)
        )
        assert gauge("vacancyd_waiting", upstream=name) == up["sharing"]["waiting"]
        forwarding = sum(1 for j in up["active_work"] if j["phase"] == "forwarding")
        assert gauge("vacancyd_active_work", upstream=name, phase="forwarding") == forwarding
    assert gauge("vacancyd_waiting", upstream="c") == 3

    # Resources: jobs and what a shared card is doing.
    for name, res in status["resources"].items():
        assert gauge("vacancyd_resource_jobs", resource=name) == res["jobs"]
        assert gauge("vacancyd_resource_lendable", resource=name) == float(res["lendable"])
        states = {
            label: gauge("vacancyd_exclusivity_state", resource=name, state=label)
            for label in ("idle", "shared", "exclusive")
        }
        if res["card"] is None:
            assert set(states.values()) == {None}, name
        else:
            assert states == {s: float(s == res["card"]) for s in states}, name
    assert status["resources"]["ram"]["jobs"] == 1 and status["resources"]["vram"]["jobs"] == 1

    # The owner's holds.
    held = {h["kind"] for h in status["owner_controls"]["holds"]}
    assert held == {"exclusive_app"}
    for kind in HoldKind:
        assert gauge("vacancyd_owner_hold", kind=kind.value) == float(kind.value in held)

    # The publisher's own health.
    assert gauge("vacancyd_kubernetes_writes_ok") == float(status["kubernetes"]["writes_ok"])
    assert "forbidden" in " ".join(status["kubernetes"]["errors"].values())
    assert status["kubernetes"]["lender"] == conditions.dns_name("pc")

    # The Node conditions: lendable while any upstream is, owner and pressure as shown.
    by_type = {c.type: c for c in conditions.node_conditions(lender)}
    any_lendable = any(up["lendable"] for up in status["upstreams"].values())
    assert by_type[conditions.LENDABLE].status is (Status.TRUE if any_lendable else Status.FALSE)
    assert "a (" in by_type[conditions.LENDABLE].message  # lending a, with its headroom
    veto = status["presence"]["veto"]["active"]
    assert gauge("vacancyd_owner_veto_active") == float(veto)
    assert by_type[conditions.OWNER_PRESENT].status is (Status.TRUE if veto else Status.FALSE)


async def test_the_scraped_registry_renders_the_same_document(tmp_path: Path) -> None:
    """``/metrics`` on the daemon's own registry shows what ``render_gauges`` shows for the
    document built at that moment: nothing is read from anywhere else."""
    settings = parse_config(settings_toml(tmp_path), "<test>")
    daemon = Daemon(settings)
    state = daemon.state
    state.clock = lambda: T0
    state.record_capacity("ram", CapacityReading(free_mib=12_000, total_mib=16_000), T0)
    state.ledger.waiting["c"] = 2
    state.holds = (Hold(HoldKind.PAUSE, "paused by the owner"),)
    live = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(
            generate_latest(daemon.metrics.registry).decode()
        )
        for s in family.samples
        if s.name.startswith("vacancyd_")
        and not s.name.startswith(("vacancyd_build", "vacancyd_state_write_failures"))
    }
    gauges = scrape(read_status(state, T0, daemon.views))
    assert {k: v for k, v in live.items() if k[0] in {g[0] for g in gauges}} == gauges
    assert gauges[("vacancyd_owner_hold", (("kind", "pause"),))] == 1.0
    assert gauges[("vacancyd_waiting", (("upstream", "c"),))] == 2.0
