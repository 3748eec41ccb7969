"""Residency proofs (gate step 6): the Ollama rules, ComfyUI's allocator credit, freshness
after jobs and yields, and the Ollama observation parsers' handling of bad replies."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.unit.test_gate import NOW, UP, resource, snapshot
from vacancyd.adapters import ollama
from vacancyd.collectors.base import ProbeError
from vacancyd.core import gate, residency
from vacancyd.core.classify import route
from vacancyd.core.observations import Observation
from vacancyd.core.policy import ResourceKind
from vacancyd.core.reasons import Admit, Reason, Refresh, Refuse
from vacancyd.core.residency import ContextKey, ContextLearning, ResidentModel
from vacancyd.core.snapshot import RequestFacts, ServerState

DIGEST = "d1" * 32
OLLAMA = replace(
    UP, adapter="ollama", default_mib=14_500, footprint_mib={}, resident_min_free_mib=0
)
LOADED = ResidentModel(
    name="big:latest",
    digest=DIGEST,
    size_mib=14_000,
    size_vram_mib=14_000,
    context_length=4096,
    expires_in_s=300.0,
)


def observed(*models: ResidentModel, age: float = 1.0, **kw: object) -> Observation[ServerState]:
    state = ServerState(resident_models=frozenset(m.name for m in models), idle=None, models=models)
    return Observation(value=state, observed_at=NOW - age, **kw)  # type: ignore[arg-type]


def decide(
    facts: RequestFacts,
    *,
    obs: Observation[ServerState] | None = None,
    learning: ContextLearning | None = None,
    free: float = 1_500,
    **view_kw: Any,
) -> Admit | Refuse:
    snap = snapshot(
        resource(free=free, **view_kw),
        servers={"ollama": obs if obs is not None else observed(LOADED)},
        learning={"ollama": learning} if learning is not None else {},
    )
    return gate.decide(facts, snap, OLLAMA)


def big(**kw: object) -> RequestFacts:
    return RequestFacts(model="big:latest", dialect="api", **kw)  # type: ignore[arg-type]


LEARNED = ContextLearning(contexts={ContextKey(DIGEST, None, "api"): 4096})


def test_a_learned_context_for_the_same_kind_of_request_proves_residency() -> None:
    decision = decide(big(), learning=LEARNED)
    assert isinstance(decision, Admit), decision
    assert decision.charged_mib == 0
    assert decision.credit is not None and decision.credit.code == "resident"


def test_an_explicit_num_ctx_equal_to_the_loaded_context_is_proof() -> None:
    assert isinstance(decide(big(num_ctx=4096)), Admit)


@pytest.mark.parametrize(
    ("facts", "obs", "learning", "why", "code"),
    [
        (big(), observed(), LEARNED, "not loaded", "not_loaded"),
        (big(num_ctx=8192), None, LEARNED, "asks for num_ctx 8192", "context_mismatch"),
        (
            big(runner_options=("num_gpu",)),
            None,
            LEARNED,
            "load-time option(s) num_gpu",
            "runner_options",
        ),
        (big(), observed(replace(LOADED, expires_in_s=29.0)), LEARNED, "unloads it in", "expiring"),
        (
            big(),
            observed(replace(LOADED, expires_in_s=-5.0)),
            LEARNED,
            "busy or being unloaded",
            "expiring",
        ),
        (
            big(),
            observed(replace(LOADED, expires_in_s=None, expires_error="expires_at 'soon' bad")),
            LEARNED,
            "'soon' bad",
            "expiry_unreadable",
        ),
        (
            big(),
            observed(replace(LOADED, context_length=None)),
            LEARNED,
            "does not report the loaded context_length",
            "context_unknown",
        ),
        (big(), None, ContextLearning(), "Modelfile has not been read", "context_unknown"),
        (
            replace(big(), dialect="v1"),
            None,
            LEARNED,
            "no request of its kind",
            "context_unknown",
        ),
        (
            big(),
            None,
            ContextLearning(contexts={ContextKey(DIGEST, None, "api"): 32768}),
            "this kind of request loads 32768",
            "context_mismatch",
        ),
    ],
    ids=[
        "not-loaded",
        "other-num-ctx",
        "runner-option",
        "expires-soon",
        "expiry-past",
        "expiry-unreadable",
        "old-server",
        "unknown-context",
        "v1-not-learned",
        "learned-other",
    ],
)
def test_requests_that_may_reload_are_charged_in_full_and_say_why(
    facts: RequestFacts,
    obs: Observation[ServerState] | None,
    learning: ContextLearning,
    why: str,
    code: str,
) -> None:
    decision = decide(facts, obs=obs, learning=learning)
    assert isinstance(decision, Refuse), decision
    assert decision.reason is Reason.INSUFFICIENT_CAPACITY
    assert decision.credit is not None and not decision.credit.applied
    assert decision.credit.code == code
    assert why in decision.detail
    assert "no residency credit" in decision.detail
    assert "14500 MiB" in decision.detail


def test_expiry_counts_down_with_the_observation_age() -> None:
    obs = observed(replace(LOADED, expires_in_s=33.0), age=3.5)
    decision = decide(big(), obs=obs, learning=LEARNED)
    assert isinstance(decision, Refuse) and "unloads it in 29.5 s" in decision.detail
    obs = observed(replace(LOADED, expires_in_s=34.0), age=3.5)
    assert isinstance(decide(big(), obs=obs, learning=LEARNED), Admit)


def test_modelfile_num_ctx_proves_an_unset_request_unless_parallel_slots_show() -> None:
    modelfile = ContextLearning(modelfile_num_ctx={DIGEST: 4096})
    assert isinstance(decide(big(), learning=modelfile), Admit)
    parallel = ContextLearning(
        contexts={ContextKey(DIGEST, 2048, "api"): 4096}, modelfile_num_ctx={DIGEST: 4096}
    )
    decision = decide(big(), learning=parallel)
    assert isinstance(decision, Refuse) and "parallel slots" in decision.detail
    other = ContextLearning(modelfile_num_ctx={DIGEST: 8192})
    decision = decide(big(), learning=other)
    assert isinstance(decision, Refuse) and "Modelfile sets num_ctx 8192" in decision.detail


def test_parallel_slots_are_covered_by_the_learned_map() -> None:
    learning = ContextLearning(contexts={ContextKey(DIGEST, 2048, "api"): 4096})
    assert isinstance(decide(big(num_ctx=2048), learning=learning), Admit)


@pytest.mark.parametrize(
    ("view_kw", "obs_age", "why"),
    [
        ({"yielded_at": NOW - 0.5}, 1.0, "predates the last yield"),
        ({"released_at": NOW - 0.5}, 1.0, "predates the last job"),
        ({}, 4.5, "4.5 s old"),
    ],
)
def test_old_observations_fail_only_for_age_and_ask_for_a_fresh_one(
    view_kw: dict[str, Any], obs_age: float, why: str
) -> None:
    if "released_at" in view_kw:  # step 5 needs a capacity sample after the release
        view_kw["capacity"] = replace(resource().capacity, observed_at=NOW - 0.1)
    decision = decide(big(), obs=observed(LOADED, age=obs_age), learning=LEARNED, **view_kw)
    assert isinstance(decision, Refuse) and decision.credit is not None
    assert decision.credit.failed_only_for_age and decision.credit.code == "stale"
    assert decision.refresh is Refresh.SERVER and decision.extra == {}
    assert why in decision.detail


def test_an_observation_after_the_yield_can_prove_again() -> None:
    decision = decide(big(), learning=LEARNED, yielded_at=NOW - 2.0)
    assert isinstance(decision, Admit)


def test_a_credit_fits_what_a_full_charge_would_not() -> None:
    decision = decide(big(), learning=LEARNED, free=100)
    assert isinstance(decision, Admit) and decision.charged_mib == 0
    decision = decide(big(num_ctx=8192), learning=LEARNED, free=100)
    assert isinstance(decision, Refuse)


# -- ComfyUI: the allocator's memory added back on a one-GPU route --------------------------

COMFY = replace(UP, adapter="comfyui", default_mib=6_000, footprint_mib={})


def comfy(allocator: float, devices: int = 1, age: float = 1.0) -> Observation[ServerState]:
    state = ServerState(resident_models=None, idle=True, allocator_mib=allocator, devices=devices)
    return Observation(value=state, observed_at=NOW - age)


def test_comfyui_allocator_memory_is_added_back_on_a_one_gpu_route() -> None:
    snap = snapshot(resource(free=2_000), servers={"ollama": comfy(5_000)})
    decision = gate.decide(RequestFacts(), snap, COMFY)
    assert isinstance(decision, Admit), decision
    assert decision.charged_mib == 6_000
    assert decision.credit is not None and decision.credit.added_mib == 5_000
    snap = snapshot(resource(free=2_000), servers={"ollama": comfy(3_000)})
    decision = gate.decide(RequestFacts(), snap, COMFY)
    assert isinstance(decision, Refuse)
    assert "a credit of 3000 MiB applied" in decision.detail


def test_comfyui_gets_no_credit_on_two_gpus_or_when_stale() -> None:
    two = replace(COMFY, also_requires=("gpu1",))
    snap = snapshot(
        resource(free=2_000), resource("gpu1", free=20_000), servers={"ollama": comfy(5_000)}
    )
    decision = gate.decide(RequestFacts(), snap, two)
    assert isinstance(decision, Refuse) and "exactly one GPU" in decision.detail
    snap = snapshot(resource(free=2_000), servers={"ollama": comfy(5_000, devices=2)})
    assert isinstance(gate.decide(RequestFacts(), snap, COMFY), Refuse)
    snap = snapshot(resource(free=2_000), servers={"ollama": comfy(5_000, age=5)})
    decision = gate.decide(RequestFacts(), snap, COMFY)
    assert (
        isinstance(decision, Refuse) and decision.refresh is Refresh.SERVER and decision.extra == {}
    )
    ram = replace(COMFY, resource="ram")
    snap = snapshot(
        resource("ram", free=2_000, kind=ResourceKind.MEMORY), servers={"ollama": comfy(5_000)}
    )
    assert isinstance(gate.decide(RequestFacts(), snap, ram), Refuse)


# -- the Ollama observation's parsers -------------------------------------------------------

WALL = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def ps_entry(**kw: object) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": "big:latest",
        "model": "big:latest",
        "size": 14_000 * 1024 * 1024,
        "digest": DIGEST,
        "details": {"format": "gguf", "families": None},
        "expires_at": "2027-01-15T01:05:00.123456789-07:00",
        "size_vram": 14_000 * 1024 * 1024,
        "context_length": 4096,
    }
    entry.update(kw)
    return {k: v for k, v in entry.items() if v is not None}


@pytest.mark.parametrize(
    ("text", "epoch"),
    [
        ("2027-01-15T01:05:00.123456789-07:00", WALL + 300.123456),
        ("2027-01-15T08:05:00Z", WALL + 300),
        ("2027-01-15T09:05:00+01:00", WALL + 300),
        ("2318-03-14T02:10:00.5+00:00", None),
    ],
)
def test_expires_at_in_the_forms_go_writes(text: str, epoch: float | None) -> None:
    value = residency.parse_expires_at(text)
    if epoch is None:
        assert value > WALL + 290 * 365 * 86400  # "forever"
    else:
        assert value == pytest.approx(epoch, abs=1e-5)


@pytest.mark.parametrize("text", ["soon", "2027-01-15", "2027-01-15T08:05:00", "", "T"])
def test_unparsable_expires_at(text: str) -> None:
    with pytest.raises(ValueError):
        residency.parse_expires_at(text)


def test_parse_ps_models() -> None:
    (model,) = ollama.parse_ps_models({"models": [ps_entry(name="Library/Big")]}, WALL)
    assert model.name == "big:latest" and model.digest == DIGEST
    assert model.context_length == 4096 and model.size_vram_mib == 14_000
    assert model.expires_in_s == pytest.approx(300.123, abs=1e-3)
    assert ollama.parse_ps_models({"models": None}, WALL) == ()
    (old,) = ollama.parse_ps_models({"models": [ps_entry(context_length=None)]}, WALL)
    assert old.context_length is None
    (bad,) = ollama.parse_ps_models({"models": [ps_entry(expires_at="tomorrow")]}, WALL)
    assert bad.expires_in_s is None and bad.expires_error and "tomorrow" in bad.expires_error
    (missing,) = ollama.parse_ps_models({"models": [ps_entry(expires_at=None)]}, WALL)
    assert missing.expires_error == "expires_at is missing"


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ([], "did not return"),
        ({"models": "big"}, "did not return"),
        ({"models": ["big"]}, "not an object"),
        ({"models": [ps_entry(name=None, model=None)]}, "without a name"),
        ({"models": [ps_entry(), ps_entry(name="big")]}, "twice"),
        ({"models": [ps_entry(size_vram="lots")]}, "size_vram"),
        ({"models": [ps_entry(context_length="4k")]}, "context_length"),
        ({"models": [ps_entry(context_length=True)]}, "context_length"),
        ({"models": [ps_entry(digest=7)]}, "digest"),
    ],
)
def test_parse_ps_rejects_garbage_naming_what_is_wrong(payload: Any, why: str) -> None:
    with pytest.raises(ProbeError, match=why):
        ollama.parse_ps_models(payload, WALL)


def test_modelfile_num_ctx_from_api_show() -> None:
    params = f'{"stop":<30} "<|end|>"\n{"num_ctx":<30} 8192\n{"temperature":<30} 0.7'
    assert ollama.parse_modelfile_num_ctx({"parameters": params}) == 8192
    assert ollama.parse_modelfile_num_ctx({"parameters": "temperature 0.7"}) is None
    assert ollama.parse_modelfile_num_ctx({"modelfile": "FROM x"}) is None
    with pytest.raises(ProbeError):
        ollama.parse_modelfile_num_ctx({"parameters": "num_ctx lots"})
    with pytest.raises(ProbeError):
        ollama.parse_modelfile_num_ctx(["num_ctx 5"])


def test_request_options_and_dialect() -> None:
    gen = route("POST", "/api/generate", ollama.WORK)
    v1 = route("POST", "/v1/chat/completions", ollama.WORK)
    assert ollama.read_options(gen, {"options": {"num_ctx": 8192, "temperature": 0}}) == (
        8192,
        (),
        "api",
    )
    assert ollama.read_options(gen, {"options": {"num_ctx": 4096.0}})[0] == 4096
    assert ollama.read_options(gen, {"options": {"num_gpu": 1, "use_mmap": False}})[1] == (
        "num_gpu",
        "use_mmap",
    )
    assert ollama.read_options(gen, {"options": {"num_ctx": "big"}})[1] == (
        "num_ctx (not a positive integer)",
    )
    assert ollama.read_options(gen, {"shift": False})[1] == ("shift",)
    assert ollama.read_options(gen, {"options": [1]})[1] == ("options (not an object)",)
    assert ollama.read_options(v1, {"options": {"num_gpu": 1}}) == (None, (), "v1")
    assert ollama.read_options(gen, None) == (None, (), "api")


def test_comfyui_system_stats() -> None:
    from vacancyd.adapters.comfyui import parse_system_stats

    gpu = {"type": "cuda", "torch_vram_total": 2048 * 1024 * 1024}
    cpu = {"type": "cpu", "torch_vram_total": 0}
    assert parse_system_stats({"devices": [gpu, cpu]}) == (2048.0, 1)
    assert parse_system_stats({"devices": [gpu, gpu]}) == (None, 2)
    assert parse_system_stats({"devices": []}) == (None, 0)
    bad: object
    for bad in ({"devices": "gpu"}, [], {"devices": [1]}, {"devices": [{"type": "cuda"}]}):
        with pytest.raises(ProbeError):
            parse_system_stats(bad)
