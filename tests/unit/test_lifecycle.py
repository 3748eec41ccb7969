"""The pure borrowed-job state machine (vacancyd.core.lifecycle): every transition and the
effects it asks the executor for."""

from __future__ import annotations

import pytest

from vacancyd.core.ledger import Admitted, Phase
from vacancyd.core.lifecycle import (
    CancelExchange,
    CancelOnServer,
    Ending,
    Follow,
    Hold,
    HoldReason,
    JobOutcome,
    JobPhase,
    JobRules,
    JobState,
    Release,
    ReleaseBy,
    SetPhase,
    WatchIdle,
)
from vacancyd.core.reclaim import Edge, Trigger

EDGE = Edge(Trigger.OWNER, 5.0, detail="owner back")
PLAIN = JobRules()
TRACKED = JobRules(tracked=True)
UNCERTAIN = JobRules(cut_is_uncertain=True, idle_evidence=True)
UNCERTAIN_BLIND = JobRules(cut_is_uncertain=True)


def admitted() -> JobState:
    return JobState(Admitted(7, "up", ("gpu0",), admitted_at=1.0, model="m"))


def test_an_untracked_job_is_released_when_its_exchange_ends() -> None:
    job = admitted()
    assert job.phase is JobPhase.ADMITTED and job.ledger_phase is Phase.FORWARDING
    fwd = job.forwarding(None).state
    assert fwd.phase is JobPhase.FORWARDING and fwd.phase.defers_reclaim
    for ending in Ending:
        t = fwd.exchange_ended(ending, PLAIN, now=2.0)
        assert t.state.phase is JobPhase.RELEASED
        assert t.effects == (Release(),)
        assert not t.state.phase.live and t.state.ledger_phase is None


def test_a_tracked_job_that_landed_is_tracked_until_done() -> None:
    fwd = admitted().forwarding("prompt-1").state
    landed = fwd.reply_arrived(200)
    assert landed.state.landed and landed.effects == ()
    t = landed.state.exchange_ended(Ending.COMPLETED, TRACKED, now=2.0)
    assert t.state.phase is JobPhase.TRACKING
    assert t.effects == (SetPhase(Phase.TRACKING), Follow("prompt-1"))
    assert t.state.phase.defers_reclaim
    done = t.state.tracking_done()
    assert done.state.phase is JobPhase.RELEASED and done.effects == (Release(),)


def test_a_tracked_submission_that_did_not_land_is_released_at_once() -> None:
    fwd = admitted().forwarding("prompt-1").state
    rejected = fwd.reply_arrived(400).state
    assert not rejected.landed
    t = rejected.exchange_ended(Ending.COMPLETED, TRACKED, now=2.0)
    assert t.state.phase is JobPhase.RELEASED and t.effects == (Release(),)


def test_lost_tracking_holds_until_an_administrator_releases() -> None:
    tracking = (
        admitted()
        .forwarding("p")
        .state.reply_arrived(200)
        .state.exchange_ended(Ending.COMPLETED, TRACKED, now=2.0)
        .state
    )
    lost = tracking.tracking_lost("queue unreadable", now=3.0)
    assert lost.state.phase is JobPhase.HELD and lost.effects == (SetPhase(Phase.HELD),)
    assert lost.state.hold is not None
    assert lost.state.hold.reason is HoldReason.TRACKING_LOST
    assert lost.state.hold.release_by is ReleaseBy.ADMIN
    assert not lost.state.phase.defers_reclaim
    # a server observation never releases an admin-only hold
    assert lost.state.server_seen_idle(99.0).state.phase is JobPhase.HELD
    freed = lost.state.admin_release()
    assert freed.state.phase is JobPhase.RELEASED and freed.effects == (Release(),)


def test_cutting_an_untracked_exchange_cancels_it() -> None:
    fwd = admitted().forwarding(None).state
    t = fwd.cut(EDGE)
    assert t.state.cut_by == EDGE and t.effects == (CancelExchange(),)
    ended = t.state.exchange_ended(Ending.CUT, PLAIN, now=6.0)
    assert ended.state.phase is JobPhase.CUT and ended.effects == (Release(),)


def test_cutting_landed_tracked_work_cancels_it_on_the_server_once() -> None:
    landed = admitted().forwarding("p").state.reply_arrived(200).state
    t = landed.cut(EDGE)
    assert t.effects == (CancelOnServer("p"),) and t.state.cancelled_on_server
    assert t.state.cut(EDGE).effects == ()  # never twice
    # the fallback cut (a failed reclaim) never calls the server
    assert landed.cut(EDGE, cancel_queued=False).effects == ()


def test_tracked_work_cut_before_it_landed_is_cancelled_when_the_reply_arrives() -> None:
    fwd = admitted().forwarding("p").state
    cut = fwd.cut(EDGE)
    assert cut.effects == () and cut.state.cut_by == EDGE
    arrived = cut.state.reply_arrived(200)
    assert arrived.effects == (CancelOnServer("p"),)
    assert arrived.state.cut_by == EDGE
    # a cut job is never tracked, even though it landed
    ended = arrived.state.exchange_ended(Ending.COMPLETED, TRACKED, now=6.0)
    assert ended.state.phase is JobPhase.CUT and ended.effects == (Release(),)


@pytest.mark.parametrize(
    ("rules", "release_by", "watch"),
    [(UNCERTAIN, ReleaseBy.SERVER_IDLE, True), (UNCERTAIN_BLIND, ReleaseBy.ADMIN, False)],
)
def test_an_uncertain_cut_holds_the_reservation(
    rules: JobRules, release_by: ReleaseBy, watch: bool
) -> None:
    cut = admitted().forwarding(None).state.cut(EDGE).state
    t = cut.exchange_ended(Ending.CUT, rules, now=6.0)
    assert t.state.phase is JobPhase.HELD
    assert t.state.hold is not None
    assert t.state.hold.reason is HoldReason.CUT_UNCERTAIN
    assert t.state.hold.release_by is release_by and t.state.hold.since == 6.0
    expected = (SetPhase(Phase.HELD), WatchIdle(6.0)) if watch else (SetPhase(Phase.HELD),)
    assert t.effects == expected
    # cutting a held job again does nothing: it no longer defers a reclaim
    assert t.state.cut(EDGE).effects == ()


def test_a_held_job_is_released_only_by_an_observation_taken_after_the_hold() -> None:
    held = (
        admitted().forwarding(None).state.cut(EDGE).state.exchange_ended(Ending.CUT, UNCERTAIN, 6.0)
    ).state
    assert held.server_seen_idle(6.0).state.phase is JobPhase.HELD
    assert held.server_seen_idle(5.0).state.phase is JobPhase.HELD
    t = held.server_seen_idle(6.5)
    assert t.state.phase is JobPhase.CUT and t.effects == (Release(),)


def test_an_admin_release_mid_exchange_frees_the_reservation_once() -> None:
    fwd = admitted().forwarding(None).state
    t = fwd.admin_release()
    assert t.effects == (Release(),) and not t.state.reserved
    assert t.state.phase is JobPhase.FORWARDING  # the exchange still runs
    assert t.state.admin_release().effects == ()
    ended = t.state.exchange_ended(Ending.COMPLETED, PLAIN, now=3.0)
    assert ended.state.phase is JobPhase.RELEASED and ended.effects == ()


def test_an_uncut_exchange_is_not_held_even_where_cuts_are_uncertain() -> None:
    fwd = admitted().forwarding(None).state
    t = fwd.exchange_ended(Ending.ABORTED, UNCERTAIN, now=3.0)
    assert t.state.phase is JobPhase.RELEASED and t.effects == (Release(),)


SILENT_WATCHED = JobRules(cut_is_uncertain=True, idle_evidence=True, silence_s=30.0)
SILENT_BLIND = JobRules(silence_s=30.0)  # a closed connection would stop it, if it listened


@pytest.mark.parametrize(
    ("rules", "release_by", "effects"),
    [
        (SILENT_WATCHED, ReleaseBy.SERVER_IDLE, (SetPhase(Phase.HELD), WatchIdle(40.0))),
        (SILENT_BLIND, ReleaseBy.ADMIN, (SetPhase(Phase.HELD),)),
    ],
)
def test_a_silent_upstream_turns_the_reservation_into_a_hold(
    rules: JobRules, release_by: ReleaseBy, effects: tuple[object, ...]
) -> None:
    fwd = admitted().forwarding(None).state
    t = fwd.went_silent(rules, now=40.0)
    assert t.state.phase is JobPhase.HELD and t.state.ledger_phase is Phase.HELD
    assert t.state.reserved, "the reservation is kept, not released"
    assert Release() not in t.effects
    assert t.effects == effects
    hold = t.state.hold
    assert hold is not None
    assert hold.reason is HoldReason.UPSTREAM_SILENT
    assert hold.release_by is release_by and hold.since == 40.0
    assert "30 s" in hold.detail
    # a held job no longer defers a reclaim, and a late exchange report changes nothing
    assert not t.state.phase.defers_reclaim
    assert t.state.cut(EDGE).effects == ()
    assert t.state.went_silent(rules, now=41.0).state == t.state


def test_a_silent_hold_ends_by_the_usual_means_only() -> None:
    held = admitted().forwarding(None).state.went_silent(SILENT_WATCHED, now=40.0).state
    assert held.server_seen_idle(39.0).state.phase is JobPhase.HELD  # taken before the hold
    idle = held.server_seen_idle(40.5)
    assert idle.state.phase is JobPhase.RELEASED and idle.effects == (Release(),)
    blind = admitted().forwarding(None).state.went_silent(SILENT_BLIND, now=40.0).state
    assert blind.server_seen_idle(99.0).state.phase is JobPhase.HELD  # admin only
    freed = blind.admin_release()
    assert freed.state.phase is JobPhase.RELEASED and freed.effects == (Release(),)


def test_a_silent_job_an_administrator_already_freed_just_ends() -> None:
    freed = admitted().forwarding(None).state.admin_release().state
    t = freed.went_silent(SILENT_BLIND, now=40.0)
    assert t.state.phase is JobPhase.RELEASED and t.effects == ()


def test_silence_before_a_tracked_submission_landed_holds_it_and_keeps_the_cut() -> None:
    cut = admitted().forwarding("prompt-1").state.cut(EDGE).state
    t = cut.went_silent(JobRules(tracked=True, silence_s=30.0), now=40.0)
    assert t.state.phase is JobPhase.HELD and t.state.cut_by == EDGE
    ended = t.state.admin_release()
    assert ended.state.phase is JobPhase.CUT and ended.effects == (Release(),)


def test_silence_means_nothing_once_the_exchange_is_over() -> None:
    tracking = (
        admitted()
        .forwarding("p")
        .state.reply_arrived(200)
        .state.exchange_ended(Ending.COMPLETED, TRACKED, now=2.0)
        .state
    )
    t = tracking.went_silent(SILENT_BLIND, now=40.0)
    assert t.state == tracking and t.effects == ()


# -- a borrower who disconnects from a server that goes on generating (llama-server) ---------

DETACHED = JobRules(cut_is_uncertain=True, idle_evidence=True, detached_s=60.0)


def disconnected(rules: JobRules = DETACHED, now: float = 10.0) -> JobState:
    return admitted().forwarding(None).state.exchange_ended(Ending.ABORTED, rules, now=now).state


def test_a_disconnect_keeps_the_job_reserved_in_tracking_until_the_server_is_seen_idle() -> None:
    t = admitted().forwarding(None).state.exchange_ended(Ending.ABORTED, DETACHED, now=10.0)
    job = t.state
    assert job.phase is JobPhase.TRACKING and job.ledger_phase is Phase.TRACKING
    assert job.reserved and Release() not in t.effects
    assert t.effects == (SetPhase(Phase.TRACKING), WatchIdle(10.0))
    assert (job.detached_since, job.detached_until) == (10.0, 70.0)
    assert job.phase.defers_reclaim  # the server still runs borrowed work
    # only an observation taken after the disconnect counts
    assert job.server_seen_idle(9.0).state == job
    assert job.server_seen_idle(10.0).state == job
    ended = job.server_seen_idle(10.2)
    assert ended.state.phase is JobPhase.RELEASED and ended.effects == (Release(),)
    assert ended.state.outcome is JobOutcome.BORROWER_DISCONNECTED


def test_detached_work_still_busy_at_its_bound_is_held_not_released() -> None:
    t = disconnected().detached_timed_out(now=70.0)
    held = t.state
    assert held.phase is JobPhase.HELD and held.reserved and Release() not in t.effects
    assert t.effects == (SetPhase(Phase.HELD), WatchIdle(70.0))
    assert held.hold is not None
    assert held.hold.reason is HoldReason.DETACHED_WORK
    assert held.hold.release_by is ReleaseBy.SERVER_IDLE and held.hold.since == 70.0
    assert "60 s" in held.hold.detail
    assert not held.phase.defers_reclaim
    assert held.server_seen_idle(69.0).state == held  # taken before the hold began
    ended = held.server_seen_idle(71.0)
    assert ended.state.phase is JobPhase.RELEASED and ended.effects == (Release(),)
    assert ended.state.outcome is JobOutcome.BORROWER_DISCONNECTED


def test_the_detached_bound_means_nothing_to_other_phases() -> None:
    fwd = admitted().forwarding(None).state
    assert fwd.detached_timed_out(now=99.0).state == fwd
    tracked = (
        admitted()
        .forwarding("p")
        .state.reply_arrived(200)
        .state.exchange_ended(Ending.COMPLETED, TRACKED, now=2.0)
        .state
    )
    assert tracked.detached_timed_out(now=99.0).state == tracked
    assert tracked.server_seen_idle(99.0).state == tracked  # ComfyUI's queue decides


def test_a_detached_job_an_administrator_released_ends_without_a_second_release() -> None:
    job = disconnected()
    freed = job.admin_release()
    assert freed.effects == (Release(),) and freed.state.phase is JobPhase.TRACKING
    assert freed.state.server_seen_idle(11.0).effects == ()
    timed_out = freed.state.detached_timed_out(now=70.0)
    assert timed_out.state.phase is JobPhase.RELEASED and timed_out.effects == ()


def test_a_disconnect_after_an_admin_release_just_ends() -> None:
    freed = admitted().forwarding(None).state.admin_release().state
    t = freed.exchange_ended(Ending.ABORTED, DETACHED, now=10.0)
    assert t.state.phase is JobPhase.RELEASED and t.effects == ()


def test_a_disconnect_ends_the_job_at_once_where_the_server_offers_no_idle_evidence() -> None:
    for rules in (PLAIN, UNCERTAIN, UNCERTAIN_BLIND):
        t = admitted().forwarding(None).state.exchange_ended(Ending.ABORTED, rules, now=3.0)
        assert t.state.phase is JobPhase.RELEASED and t.effects == (Release(),)
        assert t.state.outcome is JobOutcome.BORROWER_DISCONNECTED


def test_a_reclaim_on_detached_work_cannot_end_it_early() -> None:
    cut = disconnected().cut(EDGE)
    assert cut.state.phase is JobPhase.TRACKING and cut.state.reserved
    ended = cut.state.server_seen_idle(11.0)
    assert ended.state.phase is JobPhase.CUT and ended.effects == (Release(),)
    assert ended.state.outcome is JobOutcome.BORROWER_DISCONNECTED  # the disconnect came first


# -- how each job ended -----------------------------------------------------------------------


def test_each_ending_gives_its_outcome() -> None:
    expected = {
        Ending.COMPLETED: JobOutcome.COMPLETED,
        Ending.ABORTED: JobOutcome.BORROWER_DISCONNECTED,
        Ending.UPSTREAM_FAILED: JobOutcome.UPSTREAM_FAILED,
        Ending.CUT: JobOutcome.CUT,
    }
    for ending, outcome in expected.items():
        t = admitted().forwarding(None).state.exchange_ended(ending, PLAIN, now=2.0)
        assert t.state.outcome is outcome, ending


def test_held_and_tracked_jobs_keep_the_outcome_of_what_ended_their_exchange() -> None:
    held_cut = admitted().forwarding(None).state.cut(EDGE).state
    held_cut = held_cut.exchange_ended(Ending.CUT, UNCERTAIN, now=6.0).state
    assert held_cut.server_seen_idle(7.0).state.outcome is JobOutcome.CUT
    silent = admitted().forwarding(None).state.went_silent(SILENT_WATCHED, now=40.0).state
    assert silent.server_seen_idle(41.0).state.outcome is JobOutcome.UPSTREAM_FAILED
    tracking = (
        admitted()
        .forwarding("p")
        .state.reply_arrived(200)
        .state.exchange_ended(Ending.COMPLETED, TRACKED, now=2.0)
        .state
    )
    assert tracking.tracking_done().state.outcome is JobOutcome.COMPLETED
    cancelled = tracking.cut(EDGE).state.tracking_done().state
    assert cancelled.phase is JobPhase.CUT and cancelled.outcome is JobOutcome.CUT


def test_a_restored_hold_ends_with_the_outcome_its_reason_implies() -> None:
    for reason, outcome in [
        (HoldReason.CUT_UNCERTAIN, JobOutcome.CUT),
        (HoldReason.UPSTREAM_SILENT, JobOutcome.UPSTREAM_FAILED),
        (HoldReason.DETACHED_WORK, JobOutcome.BORROWER_DISCONNECTED),
        (HoldReason.TRACKING_LOST, JobOutcome.COMPLETED),
    ]:
        job = JobState(
            Admitted(1, "up", ("gpu0",), 0.0),
            phase=JobPhase.HELD,
            hold=Hold(reason, 0.0, ReleaseBy.ADMIN),
        )
        assert job.admin_release().state.outcome is outcome


# -- when the daemon stops --------------------------------------------------------------------


def test_a_stream_the_stop_cuts_ends_as_a_cut_not_as_a_disconnect() -> None:
    for rules in (PLAIN, JobRules(idle_evidence=True, detached_s=60.0)):
        job = admitted().forwarding(None).state.cut_for_stop().state
        t = job.exchange_ended(Ending.ABORTED, rules, now=3.0)
        assert t.state.phase is JobPhase.RELEASED and t.effects == (Release(),)
        assert t.state.outcome is JobOutcome.CUT


def test_a_stream_the_stop_cuts_is_held_where_a_cut_is_uncertain() -> None:
    for rules, release_by in (
        (UNCERTAIN_BLIND, ReleaseBy.ADMIN),
        (UNCERTAIN, ReleaseBy.SERVER_IDLE),
        (DETACHED, ReleaseBy.SERVER_IDLE),
    ):
        job = admitted().forwarding(None).state.cut_for_stop().state
        held = job.exchange_ended(Ending.ABORTED, rules, now=3.0).state
        assert held.phase is JobPhase.HELD and held.reserved
        assert held.hold == Hold(HoldReason.CUT_UNCERTAIN, 3.0, release_by)
        assert held.final_outcome is JobOutcome.CUT


def test_stopping_cuts_only_exchanges_still_running() -> None:
    done = disconnected()
    assert done.cut_for_stop().state == done
    completed = admitted().forwarding(None).state.cut_for_stop().state
    t = completed.exchange_ended(Ending.COMPLETED, UNCERTAIN, now=2.0)
    assert t.state.outcome is JobOutcome.COMPLETED and t.state.phase is JobPhase.RELEASED


def test_detached_work_still_tracked_when_the_daemon_stops_is_held() -> None:
    t = disconnected().stop_watching(DETACHED, now=20.0)
    held = t.state
    assert held.phase is JobPhase.HELD and held.reserved and Release() not in t.effects
    assert held.hold is not None and held.hold.reason is HoldReason.DETACHED_WORK
    assert held.hold.release_by is ReleaseBy.SERVER_IDLE and held.hold.since == 20.0
    assert SetPhase(Phase.HELD) in t.effects


def test_tracked_work_still_queued_when_the_daemon_stops_is_held_for_an_administrator() -> None:
    tracking = (
        admitted()
        .forwarding("p")
        .state.reply_arrived(200)
        .state.exchange_ended(Ending.COMPLETED, TRACKED, now=2.0)
        .state
    )
    held = tracking.stop_watching(TRACKED, now=5.0).state
    assert held.phase is JobPhase.HELD and held.hold is not None
    assert held.hold.reason is HoldReason.TRACKING_LOST
    assert held.hold.release_by is ReleaseBy.ADMIN


def test_stopping_leaves_jobs_whose_end_is_known_or_already_freed() -> None:
    held = admitted().forwarding(None).state.went_silent(SILENT_WATCHED, now=4.0).state
    assert held.stop_watching(SILENT_WATCHED, now=9.0).state == held
    freed = disconnected().admin_release().state
    assert freed.stop_watching(DETACHED, now=9.0).state == freed
    fresh = admitted()
    assert fresh.stop_watching(UNCERTAIN, now=9.0).state == fresh
    running = admitted().forwarding(None).state
    cut = running.stop_watching(UNCERTAIN_BLIND, now=9.0).state
    assert cut.phase is JobPhase.HELD and cut.hold is not None
    assert cut.hold.reason is HoldReason.CUT_UNCERTAIN
    plain = running.stop_watching(PLAIN, now=9.0).state
    assert plain.phase is JobPhase.RELEASED and plain.outcome is JobOutcome.CUT
