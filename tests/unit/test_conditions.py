"""vacancyd.core.conditions: /status -> LenderState -> Node conditions, EndpointSlices."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from vacancyd.core import conditions as c
from vacancyd.core.conditions import LenderState, Phase, SliceTarget, Status

T0 = 1_764_400_000.0  # 2025-11-29T07:06:40Z


def status_doc(**over: Any) -> dict[str, Any]:
    """A /status document shaped like vacancyd.api.status.render_status's."""
    doc: dict[str, Any] = {
        "lending_enabled": True,
        "presence": {"sampled": True, "veto": {"active": False}, "detail": ""},
        "resources": {"gpu0": {"kind": "gpu", "quality": "ready", "lendable": True}},
        "upstreams": {
            "ollama": {
                "lendable": True,
                "refusal": None,
                "listener": {"address": "0.0.0.0:11435", "bound": True},
            }
        },
    }
    doc.update(over)
    return doc


def refusing(reason: str, detail: str = "because") -> dict[str, Any]:
    return {
        "lendable": False,
        "refusal": {"reason": reason, "retry_after_s": 30, "detail": detail},
        "listener": {"address": "0.0.0.0:11435", "bound": True},
    }


def by_type(conds: tuple[c.Condition, ...]) -> dict[str, c.Condition]:
    return {x.type: x for x in conds}


def test_camel_turns_wire_codes_into_condition_reasons() -> None:
    assert c.camel("owner_active") == "OwnerActive"
    assert c.camel("resource_unmeasured") == "ResourceUnmeasured"
    assert c.camel("lending_disabled") == "LendingDisabled"


def test_lendable_lender_has_lendable_true_owner_away_no_pressure() -> None:
    lender = c.lender_from_status(status_doc())
    assert lender.phase is Phase.ALIVE
    assert lender.upstreams["ollama"].port == 11435
    got = by_type(c.node_conditions(lender))
    assert got[c.LENDABLE].status is Status.TRUE and got[c.LENDABLE].reason == "Lendable"
    assert got[c.OWNER_PRESENT].status is Status.FALSE
    assert got[c.OWNER_PRESENT].reason == "OwnerAway"
    assert got[c.GPU_PRESSURE].status is Status.FALSE


def test_refusal_reason_becomes_the_lendable_reason_and_message_names_it() -> None:
    doc = status_doc(
        upstreams={"ollama": refusing("owner_active", "the owner is using this machine")},
        presence={"sampled": True, "veto": {"active": True}, "detail": "steam.exe"},
    )
    got = by_type(c.node_conditions(c.lender_from_status(doc)))
    assert got[c.LENDABLE].status is Status.FALSE
    assert got[c.LENDABLE].reason == "OwnerActive"
    assert "the owner is using this machine" in got[c.LENDABLE].message
    assert got[c.OWNER_PRESENT].status is Status.TRUE
    assert "steam.exe" in got[c.OWNER_PRESENT].message


def test_pressure_refusal_sets_gpu_pressure_true() -> None:
    doc = status_doc(upstreams={"ollama": refusing("resource_pressured", "game on gpu0")})
    got = by_type(c.node_conditions(c.lender_from_status(doc)))
    assert got[c.GPU_PRESSURE].status is Status.TRUE
    assert got[c.GPU_PRESSURE].reason == "ResourcePressured"
    assert got[c.LENDABLE].reason == "ResourcePressured"


def test_unmeasured_gpu_is_unknown() -> None:
    doc = status_doc(resources={"gpu0": {"kind": "gpu", "quality": "unknown"}})
    got = by_type(c.node_conditions(c.lender_from_status(doc)))
    assert got[c.GPU_PRESSURE].status is Status.UNKNOWN
    assert got[c.GPU_PRESSURE].reason == "ResourceUnmeasured"


@pytest.mark.parametrize(
    ("presence", "gpu0", "missing"),
    [
        # presence not sampled: the gate refuses owner_active, which says nothing yet
        ({"sampled": False, "veto": {"active": False}}, None, "owner presence"),
        # presence sampled, the GPU's capacity never read (no error either)
        (
            {"sampled": True, "veto": {"active": False}},
            {"kind": "gpu", "quality": "unknown", "age_s": None, "error": None},
            "capacity of gpu0",
        ),
    ],
)
def test_before_the_first_full_sample_every_condition_is_unknown_with_one_reason(
    presence: dict[str, Any], gpu0: dict[str, Any] | None, missing: str
) -> None:
    doc = status_doc(
        presence=presence,
        upstreams={"ollama": refusing("owner_active", "presence has not been sampled yet")},
    )
    if gpu0 is not None:
        doc["resources"] = {"gpu0": gpu0}
    got = c.node_conditions(c.lender_from_status(doc))
    assert {x.status for x in got} == {Status.UNKNOWN}
    assert {x.reason for x in got} == {"AwaitingFirstSample"}
    assert all(missing in x.message for x in got)


def test_a_failing_collector_is_a_sample_not_a_wait() -> None:
    """A capacity read that failed is an answer: the lender is unlendable, not starting."""
    gpu0 = {"kind": "gpu", "quality": "unknown", "age_s": None, "error": "NVML: GPU is lost"}
    doc = status_doc(
        resources={"gpu0": gpu0}, upstreams={"ollama": refusing("resource_unmeasured")}
    )
    got = by_type(c.node_conditions(c.lender_from_status(doc)))
    assert got[c.LENDABLE].status is Status.FALSE
    assert got[c.LENDABLE].reason == "ResourceUnmeasured"
    assert got[c.OWNER_PRESENT].reason == "OwnerAway"


def test_engaged_pressure_guard_counts_even_behind_an_earlier_refusal() -> None:
    gpu: dict[str, Any] = {
        "kind": "gpu",
        "quality": "ready",
        "pressure": {"quality": "ready", "calibrated": True, "engaged": True, "detail": "game"},
    }
    doc = status_doc(
        resources={"gpu0": gpu}, upstreams={"ollama": refusing("owner_active", "owner here")}
    )
    got = by_type(c.node_conditions(c.lender_from_status(doc)))
    assert got[c.GPU_PRESSURE].status is Status.TRUE
    assert "gpu0: game" in got[c.GPU_PRESSURE].message
    calibrating = {**gpu, "pressure": {**gpu["pressure"], "engaged": False, "calibrated": False}}
    got = by_type(c.node_conditions(c.lender_from_status(status_doc(resources={"g": calibrating}))))
    assert got[c.GPU_PRESSURE].status is Status.UNKNOWN
    assert "calibrating" in got[c.GPU_PRESSURE].message
    no_gpu = status_doc(resources={"ram": {"kind": "memory", "quality": "ready"}})
    got = by_type(c.node_conditions(c.lender_from_status(no_gpu)))
    assert got[c.GPU_PRESSURE].status is Status.FALSE


def test_one_lendable_upstream_is_enough() -> None:
    doc = status_doc(
        upstreams={
            "a": refusing("insufficient_capacity"),
            "b": {"lendable": True, "listener": {"address": "0.0.0.0:1", "bound": True}},
        }
    )
    got = by_type(c.node_conditions(c.lender_from_status(doc)))
    assert got[c.LENDABLE].status is Status.TRUE
    assert "b" in got[c.LENDABLE].message


@pytest.mark.parametrize(
    ("lender", "lendable", "reason"),
    [
        (LenderState.starting(), Status.UNKNOWN, "Starting"),
        (LenderState.unreachable("gone"), Status.UNKNOWN, "LenderUnreachable"),
        (LenderState.stopped("bye"), Status.FALSE, "Stopped"),
    ],
)
def test_not_alive_phases(lender: LenderState, lendable: Status, reason: str) -> None:
    got = by_type(c.node_conditions(lender))
    assert got[c.LENDABLE].status is lendable
    assert got[c.LENDABLE].reason == reason
    assert got[c.OWNER_PRESENT].status is Status.UNKNOWN
    assert got[c.GPU_PRESSURE].status is Status.UNKNOWN


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"presence": {}},
        {"presence": {}, "upstreams": {"x": {"listener": {}}}},
        {"presence": "x", "upstreams": {}},
        {"presence": {}, "upstreams": {"x": "nope"}},
    ],
)
def test_garbage_status_is_a_format_error(doc: Any) -> None:
    with pytest.raises(c.StatusFormatError):
        c.lender_from_status(doc)


def test_condition_patch_keeps_transition_time_while_status_holds() -> None:
    lender = c.lender_from_status(status_doc())
    first = c.condition_patch(c.node_conditions(lender), [], T0)["status"]["conditions"]
    assert {x["type"] for x in first} == set(c.CONDITION_TYPES)
    assert all(x["lastTransitionTime"] == c.rfc3339(T0) for x in first)

    later = c.condition_patch(c.node_conditions(lender), copy.deepcopy(first), T0 + 60)
    later_by = {x["type"]: x for x in later["status"]["conditions"]}
    assert later_by[c.LENDABLE]["lastTransitionTime"] == c.rfc3339(T0)
    assert later_by[c.LENDABLE]["lastHeartbeatTime"] == c.rfc3339(T0 + 60)

    refused = c.lender_from_status(status_doc(upstreams={"ollama": refusing("owner_active")}))
    flipped = c.condition_patch(c.node_conditions(refused), first, T0 + 120)
    flipped_by = {x["type"]: x for x in flipped["status"]["conditions"]}
    assert flipped_by[c.LENDABLE]["lastTransitionTime"] == c.rfc3339(T0 + 120)
    # the reason changed but not the status of OwnerPresent: its transition time stays
    assert flipped_by[c.OWNER_PRESENT]["lastTransitionTime"] == c.rfc3339(T0)


def test_condition_patch_carries_only_our_types() -> None:
    kubelet = [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    patch = c.condition_patch(c.node_conditions(LenderState.starting()), kubelet, T0)
    assert [x["type"] for x in patch["status"]["conditions"]] == list(c.CONDITION_TYPES)
    assert set(patch) == {"status"} and set(patch["status"]) == {"conditions"}


def test_endpoint_flags_gated_versus_direct() -> None:
    refused = c.lender_from_status(status_doc(upstreams={"ollama": refusing("owner_active")}))
    assert c.endpoint_flags(refused, "ollama", direct=False) == (False, True)
    assert c.endpoint_flags(refused, "ollama", direct=True) == (True, True)
    ok = c.lender_from_status(status_doc())
    assert c.endpoint_flags(ok, "ollama", direct=False) == (True, True)
    gone = LenderState.unreachable("x", ok)
    assert c.endpoint_flags(gone, "ollama", direct=True) == (False, False)
    assert c.endpoint_flags(ok, "missing", direct=True) == (False, False)


def test_endpoint_slice_shape() -> None:
    body = c.endpoint_slice(
        lender="Gaming-PC",
        upstream="ollama",
        namespace="vacancy",
        target=SliceTarget("vacancyd-ollama"),
        address="192.0.2.10",
        port=11435,
        ready=False,
        serving=True,
    )
    assert body["metadata"]["name"] == "vacancyd-ollama-gaming-pc-ollama"
    labels = body["metadata"]["labels"]
    assert labels["kubernetes.io/service-name"] == "vacancyd-ollama"
    assert labels["endpointslice.kubernetes.io/managed-by"] == c.MANAGED_BY
    assert body["addressType"] == "IPv4"
    assert body["endpoints"][0]["conditions"] == {
        "ready": False,
        "serving": True,
        "terminating": False,
    }
    assert body["ports"] == [{"name": "http", "port": 11435, "protocol": "TCP"}]
    v6 = c.endpoint_slice(
        lender="l",
        upstream="u",
        namespace="n",
        target=SliceTarget("s"),
        address="2001:db8::1",
        port=1,
        ready=True,
        serving=True,
    )
    assert v6["addressType"] == "IPv6"


def test_dns_name_is_a_valid_label_even_when_long() -> None:
    name = c.dns_name("x" * 50, "Lender_With.Dots", "u" * 40)
    assert len(name) <= 63
    assert name == name.lower() and name[0].isalnum() and name[-1].isalnum()
    assert c.dns_name("x" * 50, "a", "u" * 40) != c.dns_name("x" * 50, "b", "u" * 40)


@pytest.mark.parametrize(
    ("address", "bad"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("169.254.1.1", True),
        ("fe80::1", True),
        ("0.0.0.0", True),
        ("not-an-ip", True),
        ("192.0.2.10", False),
        ("10.1.2.3", False),
    ],
)
def test_address_problem(address: str, bad: bool) -> None:
    assert (c.address_problem(address) is not None) is bad


def _one(lendable: bool, reason: str | None = None, owner: bool | None = False) -> LenderState:
    up = c.UpstreamState("chat", lendable=lendable, bound=True, port=1, reason=reason)
    return LenderState(Phase.ALIVE, owner_present=owner, upstreams={"chat": up})


def test_the_damper_ignores_start_up_refusals_but_damps_a_real_return() -> None:
    damper = c.LendableDamper(10.0)
    # a daemon that has just started: presence not sampled, a resource not measured yet
    damper.observe(_one(False, "owner_active", owner=None), 0.0)
    damper.observe(_one(False, "resource_unmeasured"), 1.0)
    damper.observe(_one(True), 2.0)
    shown, next_at = damper.apply(_one(True), 2.0)
    assert shown.upstreams["chat"].lendable and next_at is None
    # once it was lendable, even an unmeasured spell starts the stable period
    damper.observe(_one(False, "resource_unmeasured"), 3.0)
    damper.observe(_one(True), 4.0)
    shown, next_at = damper.apply(_one(True), 5.0)
    assert shown.upstreams["chat"].reason == "settling" and next_at == 14.0
    # a real refusal before the first lendable state is damped, as before
    owner_first = c.LendableDamper(10.0)
    owner_first.observe(_one(False, "owner_active", owner=True), 0.0)
    owner_first.observe(_one(True), 1.0)
    assert owner_first.apply(_one(True), 2.0)[0].upstreams["chat"].reason == "settling"


def _cond(kind: str, status: str, heartbeat: str | None) -> dict[str, Any]:
    out = {"type": kind, "status": status, "reason": "R", "message": "m"}
    if heartbeat is not None:
        out["lastHeartbeatTime"] = heartbeat
    return out


def test_stale_patch_marks_only_our_stale_conditions_unknown() -> None:
    now = c.parse_rfc3339("2026-11-29T14:10:00Z")
    assert now is not None
    current = [
        _cond("VacancyLendable", "True", "2026-11-29T14:00:00Z"),  # 600 s old
        _cond("VacancyOwnerPresent", "False", "2026-11-29T14:09:00Z"),  # fresh
        _cond("VacancyGPUPressure", "Unknown", "2026-11-29T13:00:00Z"),  # already Unknown
        _cond("Ready", "True", "2026-11-29T13:00:00Z"),  # kubelet's
        _cond("VacancyOldName", "True", "2026-11-29T13:00:00Z"),  # retired: cleanup's job
    ]
    patch = c.stale_patch(current, now, 180.0)
    assert patch is not None
    (entry,) = patch["status"]["conditions"]
    assert entry["type"] == "VacancyLendable" and entry["status"] == "Unknown"
    assert entry["reason"] == c.PUBLISHER_STALE
    assert entry["lastHeartbeatTime"] == "2026-11-29T14:00:00Z"
    assert entry["lastTransitionTime"] == "2026-11-29T14:10:00Z"
    assert "for 600 s" in entry["message"] and "last said True (R)" in entry["message"]
    assert c.stale_patch(current[1:], now, 180.0) is None
    # a condition with no time at all is vouched for by nobody
    bare_patch = c.stale_patch([_cond("VacancyLendable", "True", None)], now, 180.0)
    assert bare_patch is not None
    (bare,) = bare_patch["status"]["conditions"]
    assert bare["status"] == "Unknown" and "lastHeartbeatTime" not in bare


def test_cleanup_patch_removes_every_vacancy_condition_and_nothing_else() -> None:
    current = [
        _cond("Ready", "True", None),
        _cond("VacancyLendable", "True", None),
        _cond("VacancyOldName", "True", None),
        _cond("KernelDeadlock", "False", None),
    ]
    patch = c.cleanup_patch(current)
    assert patch == {
        "status": {
            "conditions": [
                {"type": "VacancyLendable", "$patch": "delete"},
                {"type": "VacancyOldName", "$patch": "delete"},
            ]
        }
    }
    assert c.cleanup_patch([_cond("Ready", "True", None)]) is None


def test_an_old_uninstall_marker_silences_nobody() -> None:
    now = c.parse_rfc3339("2026-11-29T14:10:00Z")
    assert now is not None
    fresh = {"metadata": {"creationTimestamp": "2026-11-29T14:09:50Z"}}
    old = {"metadata": {"creationTimestamp": "2026-11-29T13:00:00Z"}}
    assert c.uninstall_in_progress({"m": fresh}, now)
    assert not c.uninstall_in_progress({"m": old}, now)
    assert c.uninstall_in_progress({"m": {"metadata": {}}}, now)
    assert not c.uninstall_in_progress({}, now)
    marker = c.uninstall_marker("ns")
    assert c.LENDER_LABEL not in marker["metadata"]["labels"]
    assert c.SERVICE_NAME_LABEL not in marker["metadata"]["labels"]
