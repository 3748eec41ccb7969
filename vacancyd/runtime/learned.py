"""What the daemon learns and keeps across restarts: each Ollama upstream's learned context
map and Modelfile contexts, and each upstream's learned footprint priors.

Files (see :mod:`vacancyd.runtime.durable` for the atomic, versioned format):

* ``residency/UPSTREAM.json``::

    {"version": 1, "upstream": NAME,
     "contexts": [{"digest": str, "num_ctx": int | null, "dialect": "api" | "v1",
                   "loads": int}],
     "modelfile_num_ctx": {DIGEST: int | null}}

* ``footprints/UPSTREAM.json``: ``{"version": 1, "upstream": NAME, "priors": {MODEL: MiB}}``

* ``holds.json``: jobs held for uncertain completion, so a restart (or ``kill -9``) does not
  lend what may still be in use::

    {"version": 1, "holds": [{"job": int, "upstream": str, "resources": [str],
                              "model": str | null, "charged_mib": int | null,
                              "reason": "cut_uncertain" | "tracking_lost",
                              "release_by": "server_idle" | "admin", "detail": str,
                              "held_since": epoch seconds,
                              "borrower": str ("" or absent: the unnamed borrower)}]}

  A ``holds.json`` that cannot be used refuses every resource: which ones were held is
  unknown.

:func:`load_learned` reads them at startup; a file that cannot be used is logged as an error
naming it, and every resource of that upstream refuses borrowed work (``resource_unmeasured``)
until the file is repaired or removed and vacancyd restarted: a half-remembered context map
or prior could lend what does not fit. :class:`LearnedSaver` writes changes as they happen.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vacancyd.control.holds import HeldJobs
from vacancyd.control.work import Work
from vacancyd.core import footprint, residency
from vacancyd.core.ledger import Job
from vacancyd.core.lifecycle import HoldReason, JobState, ReleaseBy
from vacancyd.core.observations import CapacityReading, SampleKey
from vacancyd.core.policy import ResourceKind
from vacancyd.core.residency import ContextKey, ContextLearning
from vacancyd.core.snapshot import ServerState
from vacancyd.runtime import durable
from vacancyd.state import SharedState

log = logging.getLogger(__name__)

VERSION = 1
VERSIONS = frozenset({VERSION})

#: The most holds ``holds.json`` may list; a file with more is refused like a corrupt one
#: (every resource refuses). Each hold keeps a reservation, so a real daemon holds far fewer.
MAX_HOLDS = 1024
#: The most entries a learned context map or a priors file may have when read back.
MAX_LEARNED_ENTRIES = 4096

#: A failed write is tried again after this many seconds, doubling up to RETRY_MAX_S.
RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0


def residency_path(state_dir: Path, upstream: str) -> Path:
    return state_dir / "residency" / f"{upstream}.json"


def priors_path(state_dir: Path, upstream: str) -> Path:
    return state_dir / "footprints" / f"{upstream}.json"


def holds_path(state_dir: Path) -> Path:
    return state_dir / "holds.json"


def holds_to_json(
    jobs: list[JobState], charges: Mapping[int, int | None], mono_now: float, wall_now: float
) -> dict[str, Any]:
    """``holds.json`` for the held ``jobs`` (``charges``: MiB each was charged, by job id);
    monotonic hold times become wall-clock epochs."""
    out = []
    for job in jobs:
        hold = job.hold
        if hold is None:
            continue
        out.append(
            {
                "job": job.id,
                "upstream": job.upstream,
                "resources": list(job.resources),
                "model": job.model,
                "charged_mib": charges.get(job.id),
                "reason": hold.reason.value,
                "release_by": hold.release_by.value,
                "detail": hold.detail,
                "held_since": wall_now - (mono_now - hold.since),
                "borrower": job.borrower,
            }
        )
    return {"version": VERSION, "holds": out}


@dataclass(frozen=True, slots=True)
class SavedHold:
    """One hold read back from ``holds.json``."""

    job: int
    upstream: str
    resources: tuple[str, ...]
    model: str | None
    charged_mib: int | None
    reason: HoldReason
    release_by: ReleaseBy
    detail: str
    held_since: float
    #: Whose job it was ("": the unnamed borrower; also for files written before borrowers).
    borrower: str = ""


def holds_from_json(data: Mapping[str, Any]) -> list[SavedHold]:
    """Raises ValueError naming the first malformed entry."""
    raw = data.get("holds")
    if not isinstance(raw, list):
        raise ValueError("'holds' is not a list")
    if len(raw) > MAX_HOLDS:
        raise ValueError(f"lists {len(raw)} holds, over the limit of {MAX_HOLDS}")
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ValueError(f"holds[{i}] is not an object")
        resources = entry.get("resources")
        if (
            not isinstance(resources, list)
            or not resources
            or not all(isinstance(r, str) for r in resources)
        ):
            raise ValueError(f"holds[{i}].resources is not a list of resource names")
        upstream, model, charged = (
            entry.get("upstream"),
            entry.get("model"),
            entry.get("charged_mib"),
        )
        if not isinstance(upstream, str):
            raise ValueError(f"holds[{i}].upstream is not a string")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"holds[{i}].model is not a string or null")
        if charged is not None and not isinstance(charged, int):
            raise ValueError(f"holds[{i}].charged_mib is not a number or null")
        job, since, detail = entry.get("job"), entry.get("held_since"), entry.get("detail", "")
        if not isinstance(job, int) or not isinstance(since, int | float):
            raise ValueError(f"holds[{i}] lacks its job id or held_since")
        borrower = entry.get("borrower", "")
        if not isinstance(borrower, str):
            raise ValueError(f"holds[{i}].borrower is not a string")
        try:
            reason = HoldReason(str(entry.get("reason")))
            release_by = ReleaseBy(str(entry.get("release_by")))
        except ValueError:
            raise ValueError(f"holds[{i}] has an unknown reason or release_by") from None
        out.append(
            SavedHold(
                job,
                upstream,
                tuple(resources),
                model,
                charged,
                reason,
                release_by,
                str(detail),
                float(since),
                borrower,
            )
        )
    return out


def load_holds(state: SharedState, state_dir: Path) -> list[SavedHold]:
    """The holds saved in ``holds.json`` (empty when there is none); never raises.

    A file that cannot be used refuses every resource (``state.state_errors``).
    """
    path = holds_path(state_dir)
    try:
        data = durable.read_state(path, VERSIONS)
        return [] if data is None else holds_from_json(data)
    except durable.StateFileError as exc:
        why = exc.why
    except ValueError as exc:
        why = f"is malformed: {exc}"
    log.error(
        "durable state %s %s; which resources were held is unknown, so every resource "
        "refuses borrowed work until the file is repaired or removed and vacancyd restarted",
        path,
        why,
    )
    for name in state.resources:
        state.state_errors[name] = f"{path} {why}"
    return []


def restore_holds(work: Work, saved: list[SavedHold], declared: Collection[str]) -> list[JobState]:
    """Hold again in ``work`` each hold ``saved`` when vacancyd last stopped, on its
    resources still ``declared`` (a hold that names none of them is dropped, logged).
    Returns the restored jobs (they have new ids). Call before any proxy listens."""
    restored = []
    for hold in saved:
        resources = tuple(r for r in hold.resources if r in declared)
        if not resources:
            log.warning(
                "a hold saved for job %d on %s names no resource declared now; dropped",
                hold.job,
                ", ".join(hold.resources),
            )
            continue
        job = work.restore_hold(
            hold.upstream,
            resources,
            model=hold.model,
            charged_mib=hold.charged_mib,
            reason=hold.reason,
            release_by=hold.release_by,
            detail=hold.detail,
            borrower=hold.borrower,
        )
        log.warning(
            "%s: job %d was held (%s) when vacancyd stopped; it is job %d now and holds %s "
            "until %s",
            hold.upstream,
            hold.job,
            hold.reason.value,
            job.id,
            ", ".join(resources),
            "an observation shows the server idle"
            if hold.release_by is ReleaseBy.SERVER_IDLE
            else f"an administrator releases it (POST /admin/jobs/{job.id}/release)",
        )
        restored.append(job)
    return restored


def learning_to_json(upstream: str, learning: ContextLearning) -> dict[str, Any]:
    return {
        "version": VERSION,
        "upstream": upstream,
        "contexts": [
            {"digest": k.digest, "num_ctx": k.num_ctx, "dialect": k.dialect, "loads": v}
            for k, v in learning.contexts.items()
        ],
        "modelfile_num_ctx": dict(learning.modelfile_num_ctx),
    }


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def learning_from_json(data: Mapping[str, Any]) -> ContextLearning:
    """Raises ValueError naming the first malformed entry."""
    contexts: dict[ContextKey, int] = {}
    raw = data.get("contexts")
    if not isinstance(raw, list):
        raise ValueError("'contexts' is not a list")
    if len(raw) > MAX_LEARNED_ENTRIES:
        raise ValueError(f"lists {len(raw)} contexts, over the limit of {MAX_LEARNED_ENTRIES}")
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ValueError(f"contexts[{i}] is not an object")
        digest, num_ctx, dialect, loads = (
            entry.get("digest"),
            entry.get("num_ctx"),
            entry.get("dialect"),
            entry.get("loads"),
        )
        if not isinstance(digest, str) or not digest:
            raise ValueError(f"contexts[{i}].digest is not a string")
        if num_ctx is not None and not _positive_int(num_ctx):
            raise ValueError(f"contexts[{i}].num_ctx is not a positive integer or null")
        if dialect not in ("api", "v1"):
            raise ValueError(f"contexts[{i}].dialect is not 'api' or 'v1'")
        if not isinstance(loads, int) or not _positive_int(loads):
            raise ValueError(f"contexts[{i}].loads is not a positive integer")
        contexts[ContextKey(digest, num_ctx, str(dialect))] = loads
    modelfile: dict[str, int | None] = {}
    raw_mf = data.get("modelfile_num_ctx", {})
    if not isinstance(raw_mf, dict):
        raise ValueError("'modelfile_num_ctx' is not an object")
    if len(raw_mf) > MAX_LEARNED_ENTRIES:
        raise ValueError(
            f"'modelfile_num_ctx' has {len(raw_mf)} entries, over the limit of "
            f"{MAX_LEARNED_ENTRIES}"
        )
    for digest, value in raw_mf.items():
        if value is not None and not _positive_int(value):
            raise ValueError(f"modelfile_num_ctx[{digest!r}] is not a positive integer or null")
        modelfile[digest] = value
    return ContextLearning(contexts, modelfile)


def priors_to_json(upstream: str, priors: Mapping[str, int]) -> dict[str, Any]:
    return {"version": VERSION, "upstream": upstream, "priors": dict(priors)}


def priors_from_json(data: Mapping[str, Any]) -> dict[str, int]:
    """Raises ValueError naming the first malformed entry."""
    raw = data.get("priors")
    if not isinstance(raw, dict):
        raise ValueError("'priors' is not an object")
    if len(raw) > MAX_LEARNED_ENTRIES:
        raise ValueError(f"has {len(raw)} priors, over the limit of {MAX_LEARNED_ENTRIES}")
    out: dict[str, int] = {}
    for model, mib in raw.items():
        if not _positive_int(mib):
            raise ValueError(f"priors[{model!r}] is not a positive whole number of MiB")
        out[model] = mib
    return out


def _refuse(state: SharedState, upstream: str, path: Path, why: str) -> None:
    policy = state.upstreams[upstream]
    log.error(
        "durable state %s %s; upstream %s refuses borrowed work on %s until the file is "
        "repaired or removed and vacancyd is restarted",
        path,
        why,
        upstream,
        ", ".join(policy.resources),
    )
    for name in policy.resources:
        state.state_errors[name] = f"{path} {why}"


def load_learned(state: SharedState, state_dir: Path) -> None:
    """Read every upstream's learned files into ``state``; never raises."""
    for upstream in state.upstreams:
        path = residency_path(state_dir, upstream)
        try:
            data = durable.read_state(path, VERSIONS)
            if data is not None:
                state.learning[upstream] = learning_from_json(data)
                log.info("upstream %s: learned contexts restored from %s", upstream, path)
        except durable.StateFileError as exc:
            _refuse(state, upstream, path, exc.why)
        except ValueError as exc:
            _refuse(state, upstream, path, f"is malformed: {exc}")
        path = priors_path(state_dir, upstream)
        try:
            data = durable.read_state(path, VERSIONS)
            if data is not None:
                state.priors[upstream] = priors_from_json(data)
                log.info("upstream %s: footprint priors restored from %s", upstream, path)
        except durable.StateFileError as exc:
            _refuse(state, upstream, path, exc.why)
        except ValueError as exc:
            _refuse(state, upstream, path, f"is malformed: {exc}")


class LearnedSaver:
    """Writes learned state and held jobs when they change, off the event loop (the atomic
    write and its fsyncs run on a worker thread), one write at a time, held jobs first.

    A write that fails (read-only directory, full disk) is logged once per distinct error
    and retried, after :data:`RETRY_MIN_S` doubling up to :data:`RETRY_MAX_S` seconds, until
    it succeeds; the daemon keeps serving from what it holds in memory. ``errors`` maps each
    failing file to its error, for /status. After each write of ``holds.json`` the held jobs'
    owner (:meth:`write_holds`) is told which are on disk or why they are not, so a hold is
    shown only once a restart would find it.
    """

    def __init__(self, state: SharedState, state_dir: Path) -> None:
        self.state = state
        self.state_dir = state_dir
        self.errors = state.write_errors
        self.failures = 0
        self._dirty: set[tuple[str, str]] = set()
        self._wake = asyncio.Event()
        #: Files whose on-disk copy could not be read at startup are never overwritten.
        self._frozen = {
            u
            for u in state.upstreams
            if state.state_errors.keys() & set(state.upstreams[u].resources)
        }
        #: Whose held jobs ``holds.json`` holds (:meth:`write_holds`); None: not asked yet.
        self._held: HeldJobs | None = None
        self._holds_frozen = any(
            str(holds_path(state_dir)) in why for why in state.state_errors.values()
        )
        self._failing = False

    @property
    def holds_frozen(self) -> bool:
        """``holds.json`` could not be used at startup: it is never written (every
        resource refuses until it is repaired or removed and vacancyd restarted)."""
        return self._holds_frozen

    def write_holds(self, source: HeldJobs) -> None:
        """Write ``source``'s held jobs to ``holds.json`` soon; after each write, tell it
        which job ids are on disk (``holds_saved``) or why they are not
        (``holds_unsaved``). Never writes a ``holds.json`` that could not be read at
        startup (:attr:`holds_frozen`)."""
        self._held = source
        self.mark("holds", "")

    def mark(self, kind: str, upstream: str) -> None:
        """Write ``kind`` ("holds", "residency" or "footprints") of ``upstream`` soon."""
        if kind == "holds" and self._holds_frozen:
            return
        if kind != "holds" and upstream in self._frozen:
            return
        self._dirty.add((kind, upstream))
        self._wake.set()

    async def run(self) -> None:
        """Save forever, retrying failed writes; cancel to stop (call :meth:`flush`
        afterwards)."""
        delay = RETRY_MIN_S
        while True:
            if self._failing:
                try:
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                delay = min(delay * 2, RETRY_MAX_S)
            else:
                await self._wake.wait()
                delay = RETRY_MIN_S
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write every file marked since the last flush; a failed one stays marked."""
        self._failing = False
        # Held jobs first: new borrowed work on their resources waits for that write.
        for item in sorted(self._dirty, key=lambda i: (i[0] != "holds", i)):
            kind, upstream = item
            # Taken off before the state is read: a change made while this write is in
            # flight marks the file again, so it is written once more with that change
            # (dropping the mark after the write would keep the older state on disk).
            self._dirty.discard(item)
            held: list[JobState] = []
            if kind == "holds":
                path = holds_path(self.state_dir)
                held = self._held.held() if self._held is not None else []
                charges = {
                    j.id: entry.charged_mib
                    for j in held
                    if (entry := self.state.ledger.get(j.id)) is not None
                }
                data = holds_to_json(held, charges, self.state.clock(), time.time())
            elif kind == "residency":
                path = residency_path(self.state_dir, upstream)
                data = learning_to_json(
                    upstream, self.state.learning.get(upstream, ContextLearning())
                )
            else:
                path = priors_path(self.state_dir, upstream)
                data = priors_to_json(upstream, self.state.priors.get(upstream, {}))
            try:
                await asyncio.to_thread(durable.write_state, path, data)
            except asyncio.CancelledError:
                self._dirty.add(item)  # a cancelled save is redone by flush() at shutdown
                raise
            except OSError as exc:  # retried by run()
                self.failures += 1
                self._dirty.add(item)
                self._failing = True
                message = f"{exc.strerror or exc}"
                if kind == "holds" and self._held is not None:
                    self._held.holds_unsaved(f"{path}: {message}")
                if self.errors.get(str(path)) != message:
                    log.error(
                        "cannot write durable state %s: %s; %s (the write is retried)",
                        path,
                        message,
                        "the held jobs in it are kept in memory"
                        if kind == "holds"
                        else "what was learned is kept in memory and lost on restart until "
                        "the state directory is writable",
                    )
                self.errors[str(path)] = message
            else:
                if self.errors.pop(str(path), None) is not None:
                    log.info("durable state %s written again", path)
                if kind == "holds" and self._held is not None:
                    self._held.holds_saved(frozenset(j.id for j in held))


class Learner:
    """Learns from each borrowed job's end, on the samples that follow it: the footprint
    prior of the model it loaded (the memory drop of a GPU resource, in MiB) and, for
    Ollama, the context its kind of request loads (with each server observation's
    Modelfile contexts). Writes what it learned into the store (``state.priors``,
    ``state.learning``) and tells ``changed(kind, upstream)`` ("footprints" or
    "residency") so it is persisted. Touch only from the event loop.

    The daemon's collectors call :meth:`capacity_sampled` and :meth:`server_sampled` with
    each sample before recording it in the store; ``Work`` calls :meth:`after_release`.
    """

    def __init__(self, state: SharedState, changed: Callable[[str, str], None]) -> None:
        self.state = state
        self._changed = changed
        #: Per upstream, the last released job whose loaded context is still to be read,
        #: when it was released, and how many unloads its upstream had then.
        self._to_learn: dict[str, tuple[Job, float, int]] = {}
        #: Per resource, the last released job whose memory drop is still to be measured.
        self._to_measure: dict[str, tuple[Job, float]] = {}

    def after_release(self, job: Job, now: float) -> None:
        """A borrowed job was released at ``now`` (monotonic s): watch the next samples to
        learn its model's footprint prior and loaded context."""
        if job.model is not None and job.free_before_mib is not None:
            self._to_measure[job.resources[0]] = (job, now)
        if job.facts is not None and job.facts.dialect is not None:
            self._to_learn[job.upstream] = (job, now, self.state.unloads.get(job.upstream, 0))
            self.state.samples.request(SampleKey.server(job.upstream))

    def capacity_sampled(self, name: str, reading: CapacityReading, now: float) -> None:
        """A capacity sample of resource ``name`` taken at ``now`` (monotonic s)."""
        pending = self._to_measure.get(name)
        if pending is not None and now > pending[1]:
            del self._to_measure[name]
            self._learn_prior(pending[0], reading)

    def server_sampled(self, upstream: str, server: ServerState, now: float) -> None:
        """A server observation of ``upstream`` taken at ``now`` (monotonic s)."""
        state = self.state
        changed = False
        learned = state.learning.get(upstream, ContextLearning())
        if server.modelfile_num_ctx:
            merged = {**learned.modelfile_num_ctx, **server.modelfile_num_ctx}
            if merged != learned.modelfile_num_ctx:
                learned = ContextLearning(learned.contexts, merged)
                changed = True
        pending = self._to_learn.get(upstream)
        if pending is not None and now > pending[1] and server.models is not None:
            del self._to_learn[upstream]
            job, _, unloads = pending
            contexts = None
            if state.unloads.get(upstream, 0) == unloads:  # else a reclaim unloaded it since
                contexts = self._learn_from(upstream, job, server, learned.contexts)
            if contexts is not None:
                learned = ContextLearning(contexts, learned.modelfile_num_ctx)
                changed = True
        if changed:
            state.learning[upstream] = learned
            self._changed("residency", upstream)

    def _learn_from(
        self,
        upstream: str,
        job: Job,
        server: ServerState,
        contexts: Mapping[ContextKey, int],
    ) -> dict[ContextKey, int] | None:
        """The learned context map after job ``job``, or None when it teaches nothing.

        The first observation after a borrowed job ended shows the context that job's kind of
        request loads, as long as no other job has been admitted since (the ledger admits one
        at a time per resource, so the model was not touched by other borrowed work).
        """
        facts = job.facts
        if facts is None or facts.model is None or facts.runner_options or facts.dialect is None:
            return None
        if any(j.upstream == upstream for j in self.state.ledger.jobs()):
            return None
        model = residency.find_model(server.models or (), facts.model)
        if model is None or model.digest is None or model.context_length is None:
            return None
        key = ContextKey(model.digest, facts.num_ctx, facts.dialect)
        if contexts.get(key) == model.context_length:
            return None
        log.info(
            "upstream %s: requests for %s (num_ctx %s, /%s) load context %d",
            upstream,
            facts.model,
            "unset" if facts.num_ctx is None else facts.num_ctx,
            facts.dialect,
            model.context_length,
        )
        return residency.learn_context(contexts, key, model.context_length)

    def _learn_prior(self, job: Job, after: CapacityReading) -> None:
        """Raise the model's footprint prior to the memory drop its job was seen to cause.

        Only when no other job was admitted on the resource meanwhile, and only for a job
        that may have loaded its model (no residency credit applied).
        """
        state = self.state
        if job.model is None or (job.credit is not None and job.credit.applied):
            return
        policy = state.resources.get(job.resources[0])
        if policy is None or policy.kind is not ResourceKind.GPU:
            return  # system memory moves with every process on the host: a drop proves nothing
        if any(job.resources[0] in j.resources for j in state.ledger.jobs()):
            return
        drop = footprint.observed_drop(job.free_before_mib, after.free_mib)
        if drop is None:
            return
        priors = footprint.learn_prior(state.priors.get(job.upstream, {}), job.model, drop)
        if priors is None:
            return
        state.priors[job.upstream] = priors
        log.info(
            "upstream %s: loading %s took %d MiB of %s; footprint prior raised to %d MiB",
            job.upstream,
            job.model,
            drop,
            job.resources[0],
            drop,
        )
        self._changed("footprints", job.upstream)
