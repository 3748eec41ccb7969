"""vacancyd.core.statusbuild: the status document is a pure function of its inputs."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.test_gate import NOW, UP, presence, resource, snapshot
from vacancyd.core.reach import Reach
from vacancyd.core.reasons import Reason
from vacancyd.core.status import ListenerStatus
from vacancyd.core.statusbuild import StatusInputs, build_status


def inputs(**kw: object) -> StatusInputs:
    base = StatusInputs(
        now=NOW,
        version="1.2.3",
        snapshot=snapshot(resource(min_free_mib=1_000)),
        upstreams={"ollama": UP},
        started_at=NOW - 60,
        listeners={
            "ollama": ListenerStatus("127.0.0.1:11435", True, None),
            "pool": ListenerStatus("127.0.0.1:9000", True, None),
        },
        pools={"pool": ("ollama",)},
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_the_document_comes_from_the_inputs_alone() -> None:
    doc = build_status(inputs())
    assert doc == build_status(inputs())  # nothing beside the inputs is read
    assert doc.version == "1.2.3" and doc.uptime_s == 60 and doc.ready
    up = doc.upstreams["ollama"]
    assert up.lendable and up.refusal is None and not up.busy
    # The largest configured model that fits the 9 000 MiB left above min_free_mib.
    assert up.headroom is not None and up.headroom.largest_model == "small"
    assert up.listener is not None and up.listener.state == "unknown"
    gpu = doc.resources["gpu0"]
    assert gpu.lendable and gpu.lendable_mib == 9_000
    assert doc.pools["pool"].lendable
    assert doc.pools["pool"].listener == ListenerStatus("127.0.0.1:9000", True, None)


def test_what_the_gate_would_refuse_is_shown_with_its_reason() -> None:
    owner = snapshot(resource(min_free_mib=1_000), presence=presence(veto_active=True))
    doc = build_status(inputs(snapshot=owner, busy=frozenset({"ollama"}), not_ready=("x",)))
    up = doc.upstreams["ollama"]
    assert up.refusal is not None and up.refusal.reason == Reason.OWNER_ACTIVE.value
    assert up.busy and not doc.pools["pool"].lendable
    assert not doc.ready and doc.not_ready == ("x",)
    assert doc.presence.veto.active


def test_reach_evidence_older_than_its_limit_is_not_shown() -> None:
    fresh = Reach(ok=True, at=NOW - 5)
    assert build_status(inputs(reach={"ollama": fresh})).upstreams["ollama"].reachable
    old = inputs(reach={"ollama": fresh}, reach_max_age_s=4.0)
    assert build_status(old).upstreams["ollama"].reachable is None
