"""The handle of one admitted borrowed job: how its carrier (the proxy) reports the exchange.

:class:`~vacancyd.control.admission.Admission` hands out one :class:`JobHandle` per admitted
job (in :class:`~vacancyd.control.admission.Admitted`). The proxy reports the exchange through
it, in this order:

1. :meth:`JobHandle.forwarding`: the exchange starts, with the job key the upstream's
   controller tracks (None when untracked) and the exchange itself, a
   :class:`~vacancyd.core.lifecycle.Cuttable` that a reclaim cuts by calling its ``cut(edge)``;
2. :meth:`JobHandle.reply_arrived`: the reply's headers arrived (tracked work);
3. once, :meth:`JobHandle.used`: the tokens and bytes the exchange carried, for the usage
   ledger (docs/borrowers.md);
4. once, :meth:`JobHandle.ended` with the exchange's
   :class:`~vacancyd.core.lifecycle.Ending`, or :meth:`JobHandle.silent` when the upstream
   sent nothing for its silence limit.

The job's life (release, tracking, holds) is :class:`~vacancyd.control.work.Work`'s; the
handle is only the way in, so nothing outside the control layer names a job by its id to
report on it.
"""

from __future__ import annotations

from vacancyd.control.work import Work
from vacancyd.core.lifecycle import Cuttable, Ending, JobState
from vacancyd.core.reclaim import Edge


class JobHandle:
    """One admitted job, held by the proxy while it forwards it.

    ``admitted``: the job's record as admitted (id, upstream, resources, model, admission
    time in monotonic s, ``borrower``: "" for the unnamed borrower of the single borrow
    token). Reports after the job has ended are ignored.
    """

    __slots__ = ("_work", "admitted")

    def __init__(self, work: Work, admitted: JobState) -> None:
        self._work = work
        self.admitted = admitted

    @property
    def id(self) -> int:
        return self.admitted.id

    @property
    def upstream(self) -> str:
        return self.admitted.upstream

    @property
    def borrower(self) -> str:
        return self.admitted.borrower

    @property
    def state(self) -> JobState | None:
        """The job's record now; None once it has ended."""
        return self._work.get(self.admitted.id)

    @property
    def cut_by(self) -> Edge | None:
        """The reclaim edge that cut the job, or None."""
        job = self._work.get(self.admitted.id)
        return None if job is None else job.cut_by

    def forwarding(self, key: str | None, exchange: Cuttable) -> None:
        """The exchange starts: ``key`` is the job key the upstream's controller tracks (None
        when untracked); a reclaim cuts ``exchange`` by calling ``exchange.cut(edge)``,
        at once when a reclaim cut the job before it started."""
        self._work.forwarding(self.admitted.id, key, exchange)

    def reply_arrived(self, status: int) -> Edge | None:
        """The upstream's reply headers arrived with HTTP ``status``; returns the edge that
        cut the job if a reclaim already did (the proxy then answers as for a cut)."""
        return self._work.reply_arrived(self.admitted.id, status)

    @property
    def accounted(self) -> bool:
        """True when what the exchange carries is counted (:meth:`used`): the proxy reads
        the reply's tokens only then."""
        return self._work.accounting is not None

    def used(
        self,
        *,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        bytes_in: int,
        bytes_out: int,
    ) -> None:
        """What the exchange carried, told once before :meth:`ended` or :meth:`silent`: the
        tokens the server reported (None: not reported or not read) and the body bytes read
        from the borrower and sent to it."""
        self._work.exchanged(
            self.admitted.id,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            bytes_in=bytes_in,
            bytes_out=bytes_out,
        )

    def ended(self, ending: Ending) -> None:
        """The exchange is over; ``ending`` says how (releasing or tracking the job)."""
        self._work.exchange_ended(self.admitted.id, ending)

    def silent(self) -> None:
        """The proxy gave up on the exchange: the upstream sent nothing for its
        ``upstream_silence_s``. The exchange is over; the job is held."""
        self._work.upstream_silent(self.admitted.id)

    def __repr__(self) -> str:
        return f"JobHandle(job {self.admitted.id} on {self.admitted.upstream!r})"
