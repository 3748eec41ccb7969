"""Admission ledger: one job per resource, release times, phases."""

from __future__ import annotations

from vacancyd.core.ledger import Job, Ledger, Phase
from vacancyd.core.reasons import Reason, Refuse


def test_one_job_per_resource_and_release() -> None:
    ledger = Ledger()
    first = ledger.reserve("a", ("gpu0", "ram"), now=1.0, model="m")
    assert isinstance(first, Job) and first.phase is Phase.FORWARDING
    second = ledger.reserve("b", ("ram",), now=1.5)
    assert isinstance(second, Refuse)
    assert second.reason is Reason.RESOURCE_BUSY and second.retry_after_s == 2
    assert second.resource == "ram" and "'a'" in second.detail
    independent = ledger.reserve("c", ("gpu1",), now=1.6)
    assert isinstance(independent, Job)

    assert ledger.release(first.id, now=2.0) == first
    assert ledger.released_at("gpu0") == 2.0 and ledger.released_at("ram") == 2.0
    assert ledger.released_at("gpu1") is None
    assert ledger.release(first.id, now=3.0) is None  # idempotent
    assert ledger.released_at("gpu0") == 2.0
    assert isinstance(ledger.reserve("b", ("ram",), now=2.1), Job)


def test_phases_and_counts() -> None:
    ledger = Ledger()
    job = ledger.reserve("a", ("gpu0",), now=0.0)
    assert isinstance(job, Job)
    ledger.set_phase(job.id, Phase.HELD)
    assert ledger.counts()[("a", Phase.HELD)] == 1
    assert ledger.counts()[("a", Phase.FORWARDING)] == 0
    holder = ledger.holder("gpu0")
    assert holder is not None and holder.phase is Phase.HELD
    ledger.set_phase(999, Phase.TRACKING)  # unknown job: ignored
    assert [j.id for j in ledger.jobs()] == [job.id]


def test_active_jobs_per_upstream_count_only_upstreams_with_jobs() -> None:
    ledger = Ledger()
    assert ledger.active_per_upstream() == {}
    first = ledger.reserve("a", ("gpu0",), now=0.0)
    ledger.reserve("a", ("gpu1",), now=0.0)
    ledger.reserve("b", ("ram",), now=0.0)
    assert ledger.active_per_upstream() == {"a": 2, "b": 1}
    assert isinstance(first, Job)
    ledger.release(first.id, now=1.0)
    assert ledger.active_per_upstream() == {"a": 1, "b": 1} == dict(ledger.jobs_per_upstream())
