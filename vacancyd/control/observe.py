"""What the control layer tells others about borrowed jobs: :class:`JobObserver`, passed to
:class:`vacancyd.control.work.Work` at construction (the runtime's power limiter is one)."""

from __future__ import annotations

from typing import Protocol

from vacancyd.core.ledger import Job


class JobObserver(Protocol):
    """Told when a borrowed job starts holding its resources and when it stops.

    ``job_started``: the ledger reserved ``job`` (admitted; its resources are held from now).
    ``job_ended``: the ledger released it (finished, cut, dropped or a hold released). Both
    are called on the event loop and must not block it; an exception is logged, never
    raised into the job's life.
    """

    def job_started(self, job: Job) -> None: ...

    def job_ended(self, job: Job) -> None: ...
