"""The diagnostics bundle's recent events keep the lender's own changes under a flood of
borrowed jobs (each job's start and end is an event on the bus, for ``/events``)."""

from __future__ import annotations

from tests.support.config import daemon_toml, upstream
from vacancyd.api.ops import RECENT_EVENTS, Diagnostics
from vacancyd.config import parse_config
from vacancyd.core.events import JobChanged, ListenerChanged
from vacancyd.runtime.daemon import Daemon


def test_job_events_do_not_push_the_lenders_changes_out_of_the_bundle() -> None:
    settings = parse_config(daemon_toml(upstream("up", "http://127.0.0.1:9")), "<test>")
    daemon = Daemon(settings)
    diagnostics = Diagnostics(
        daemon.state, settings, started_at=0.0, secrets=lambda: (), users=lambda: ()
    )
    daemon.state.events.emit(ListenerChanged("up", True))
    for job in range(3 * RECENT_EVENTS):
        daemon.state.events.emit(JobChanged(job, "up", "default", "started", "m", None, 1.0))
    kinds = [event["kind"] for event in diagnostics.events]
    assert "job" not in kinds
    assert kinds[-1] == ListenerChanged.kind
