"""The learned footprint prior: a borrowed load's memory drop on a GPU raises the model's
prior (never lowers it); system memory teaches nothing; a credited job teaches nothing."""

from __future__ import annotations

from vacancyd.core import footprint
from vacancyd.core.observations import CapacityReading
from vacancyd.core.policy import ResourceKind, ResourcePolicy, UpstreamPolicy
from vacancyd.core.reasons import Credit
from vacancyd.runtime.learned import Learner
from vacancyd.state import SharedState


def state(kind: ResourceKind) -> SharedState:
    return SharedState(
        {"r": ResourcePolicy("r", kind)},
        {"up": UpstreamPolicy("up", "ollama", "r")},
        presence_source="headless",
        clock=lambda: 0.0,
    )


def load(s: SharedState, before: float, after: float, credit: Credit | None = None) -> None:
    job = s.ledger.reserve("up", ("r",), 1.0, "m", free_before_mib=before, credit=credit)
    assert not isinstance(job, type(None)) and hasattr(job, "id")
    released = s.ledger.release(job.id, 2.0)
    assert released is not None
    learner = Learner(s, lambda _kind, _upstream: None)
    learner.after_release(released, 2.0)
    learner.capacity_sampled("r", CapacityReading(after, 16_000), 3.0)


def test_a_gpu_load_raises_the_prior_and_never_lowers_it() -> None:
    s = state(ResourceKind.GPU)
    load(s, 15_000, 1_000)
    assert s.priors == {"up": {"m": 14_000}}
    load(s, 15_000, 5_000)
    assert s.priors == {"up": {"m": 14_000}}


def test_system_memory_and_credited_jobs_teach_nothing() -> None:
    s = state(ResourceKind.MEMORY)
    load(s, 15_000, 1_000)
    assert s.priors == {}
    g = state(ResourceKind.GPU)
    load(g, 15_000, 1_000, Credit(True, "resident", code="resident"))
    assert g.priors == {}


def test_charge_is_the_larger_of_configured_and_learned() -> None:
    assert footprint.charge_for(10_000, 14_000) == (14_000, True)
    assert footprint.charge_for(10_000, 9_000) == (10_000, False)
    assert footprint.charge_for(10_000, None) == (10_000, False)
    assert footprint.observed_drop(15_000, 14_990) is None  # noise
