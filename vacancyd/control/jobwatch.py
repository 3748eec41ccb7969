"""Watching a borrowed job the server may still run, for :class:`~vacancyd.control.work.Work`.

Each function here is one task's body, which ``Work`` spawns and which reports back only by
stepping the job's state machine (``step(job_id, transition)``, Work's own executor):

* :func:`follow`: a landed tracked job (ComfyUI's queue) until the server has finished it;
* :func:`await_idle`: a held job, or the abandoned request of a borrower who disconnected,
  until a server observation taken after the hold or the disconnect shows the server idle
  (llama-server's slots); detached work that still looks busy at its ``detached_until`` is
  held instead.

:func:`hold_line` is the log line of a new hold. Times are monotonic seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial

from vacancyd.adapters.base import Controller, UpstreamError
from vacancyd.core.lifecycle import HoldReason, JobPhase, JobState, ReleaseBy, Transition
from vacancyd.core.observations import SampleKey
from vacancyd.state import SharedState

#: Work's logger: the watch's lines are the job's (``vacancyd.control.work``).
log = logging.getLogger("vacancyd.control.work")

#: How long one wait for a fresh server sample lasts at most (seconds).
IDLE_WAIT_S = 2.0
#: While a held or detached job waits for its server to be seen idle, the server is asked
#: at most this often (seconds): quick enough to release soon after it stops, gentle on it.
IDLE_POLL_S = 0.25

#: Applies one input to job ``job_id``'s state machine (nothing when it has ended).
Step = Callable[[int, Callable[[JobState], Transition]], None]


async def follow(
    controller: Controller, key: str, job_id: int, step: Step, clock: Callable[[], float]
) -> None:
    """Wait until the server no longer runs or queues tracked job ``key``; the job's
    tracking then ends, or is lost (held for an administrator) when the server's queue
    cannot be read."""
    try:
        await controller.wait_done(key)
    except UpstreamError as exc:
        detail = str(exc)
        step(job_id, lambda j: j.tracking_lost(detail, clock()))
        return
    except BaseException:
        step(job_id, JobState.tracking_done)
        raise
    step(job_id, JobState.tracking_done)


async def await_idle(
    watch: JobState,
    get: Callable[[int], JobState | None],
    step: Step,
    state: SharedState,
    watched: set[int],
    *,
    wait_s: float = IDLE_WAIT_S,
    poll_s: float = IDLE_POLL_S,
) -> None:
    """Release held job ``watch``, or end the tracking of its disconnected borrower's
    request, once a server observation taken after the hold or the disconnect shows the
    server idle; hold detached work still busy at ``detached_until``. ``get(id)``: the job
    now. Asks for a fresh server sample at most every ``poll_s`` seconds, waiting at most
    ``wait_s`` for each; leaves ``watched`` (job ids) when the job no longer needs it."""
    name, job_id = watch.upstream, watch.id
    key = SampleKey.server(name)
    polled_at: float | None = None
    try:
        while (job := get(job_id)) is not None and (since := idle_since(job)) is not None:
            obs = state.servers.get(name)
            if (
                obs is not None
                and obs.value is not None
                and obs.observed_at is not None
                and obs.observed_at > since
                and obs.value.idle
            ):
                log.info(
                    "%s: server idle %s; releasing job %d",
                    name,
                    "after the cut"
                    if job.phase is JobPhase.HELD
                    else "after the borrower disconnected",
                    job_id,
                )
                step(job_id, partial(JobState.server_seen_idle, observed_at=obs.observed_at))
                continue
            wait = wait_s
            until = job.detached_until if job.phase is JobPhase.TRACKING else None
            if until is not None:
                now = state.clock()
                if now >= until:
                    step(job_id, partial(JobState.detached_timed_out, now=now))
                    continue
                wait = min(wait, until - now)
            now = state.clock()
            if polled_at is not None and now - polled_at < poll_s:
                await asyncio.sleep(min(wait, poll_s - (now - polled_at)))
                continue
            polled_at = now
            if not await state.samples.fresh(key, wait):
                await asyncio.sleep(wait)
    finally:
        watched.discard(job_id)


def idle_since(job: JobState) -> float | None:
    """Monotonic s after which a server observation showing the server idle ends ``job``'s
    hold or tracking; None when no observation can (the job is not watched)."""
    hold = job.hold
    if job.phase is JobPhase.HELD and hold is not None and hold.release_by is ReleaseBy.SERVER_IDLE:
        return hold.since
    if job.phase is JobPhase.TRACKING and job.detached_since is not None:
        return job.detached_since
    return None


def hold_line(job: JobState) -> str:
    """The warning logged when ``job`` is held: why, and what will release it."""
    hold = job.hold
    assert hold is not None
    until = (
        "an observation shows the server idle"
        if hold.release_by is ReleaseBy.SERVER_IDLE
        else f"an administrator releases it (POST /admin/jobs/{job.id}/release)"
    )
    if hold.reason is HoldReason.TRACKING_LOST:
        return (
            f"{job.upstream}: lost track of borrowed job {job.key} ({hold.detail}); holding "
            f"its reservation until an administrator releases job {job.id}"
        )
    if hold.reason is HoldReason.DETACHED_WORK:
        return f"{job.upstream}: job {job.id}: {hold.detail}; holding its reservation until {until}"
    if hold.reason is HoldReason.UPSTREAM_SILENT:
        return (
            f"{job.upstream}: job {job.id}: {hold.detail}; gave up on the exchange, but the "
            f"server may still be working on it: holding its reservation until {until}"
        )
    return (
        f"{job.upstream}: job {job.id} was cut by a reclaim but the server may still be "
        f"working on it; holding its reservation until {until}"
    )
