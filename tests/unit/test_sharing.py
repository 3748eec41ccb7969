"""Slots and exclusivity rules (vacancyd.core.sharing)."""

from __future__ import annotations

from vacancyd.core.policy import UpstreamPolicy
from vacancyd.core.reasons import Reason
from vacancyd.core.sharing import (
    CardState,
    UnloadTimeout,
    after_unload,
    card_state,
    excluded_by,
    serve_order,
    slot_refusal,
)


def policies(**overrides: UpstreamPolicy) -> dict[str, UpstreamPolicy]:
    base = {
        "llm": UpstreamPolicy("llm", "ollama", "gpu", max_concurrent=4),
        "img": UpstreamPolicy("img", "comfyui", "gpu", exclusive_of=frozenset({"llm"})),
        "solo": UpstreamPolicy("solo", "openai", "gpu"),
        "other": UpstreamPolicy("other", "openai", "gpu2", max_concurrent=2),
    }
    base.update(overrides)
    marks = excluded_by(base)
    return {
        n: UpstreamPolicy(
            p.name,
            p.adapter,
            p.resource,
            p.also_requires,
            max_concurrent=p.max_concurrent,
            exclusive_of=p.exclusive_of,
            excluded_by=marks[n],
        )
        for n, p in base.items()
    }


def test_slots_bound_jobs_per_resource() -> None:
    ps = policies()
    llm = ps["llm"]
    assert slot_refusal(llm, {}, ps, {}) is None
    assert slot_refusal(llm, {"gpu": ["llm"] * 3}, ps, {}) is None
    full = slot_refusal(llm, {"gpu": ["llm"] * 4}, ps, {})
    assert full is not None and full.reason is Reason.RESOURCE_BUSY and full.resource == "gpu"
    assert "lent to 4 borrowed job(s) (upstream 'llm' × 4); at most 4" in full.detail


def test_the_smallest_limit_on_the_resource_wins() -> None:
    ps = policies()
    # a default single-slot upstream never joins others, and nobody joins it
    assert slot_refusal(ps["solo"], {"gpu": ["llm"]}, ps, {}) is not None
    assert slot_refusal(ps["llm"], {"gpu": ["solo"]}, ps, {}) is not None
    assert slot_refusal(ps["other"], {"gpu": ["llm"]}, ps, {}) is None  # different resource


def test_exclusive_upstream_never_overlaps_and_goes_first() -> None:
    ps = policies()
    img, llm = ps["img"], ps["llm"]
    assert llm.excluded_by == {"img"}
    busy = slot_refusal(img, {"gpu": ["llm"]}, ps, {})
    assert busy is not None and "never shares it with 'img'" in busy.detail
    assert slot_refusal(llm, {"gpu": ["img"]}, ps, {}) is not None
    # an image job waiting for the card stops new LLM admissions even with slots free
    pending = slot_refusal(llm, {"gpu": ["llm"]}, ps, {"img": 1})
    assert pending is not None and "'img' is waiting to use 'gpu' exclusively" in pending.detail
    assert slot_refusal(llm, {"gpu": ["llm"]}, ps, {"img": 0}) is None
    assert slot_refusal(img, {}, ps, {"img": 3}) is None
    assert serve_order(ps) == ["img", "llm", "other", "solo"]


def test_card_state() -> None:
    ps = policies()
    assert card_state("gpu", {}, ps) is CardState.IDLE
    assert card_state("gpu", {"gpu": ["llm", "llm"]}, ps) is CardState.SHARED
    assert card_state("gpu", {"gpu": ["img"]}, ps) is CardState.EXCLUSIVE


def test_unload_timeout_choice() -> None:
    assert after_unload(True, UnloadTimeout.REFUSE, "") is None
    assert after_unload(False, UnloadTimeout.FORWARD, "llama3 still resident") is None
    refusal = after_unload(False, UnloadTimeout.REFUSE, "llama3 still resident")
    assert refusal is not None and refusal.reason is Reason.RESOURCE_BUSY
    assert "llama3 still resident" in refusal.detail
