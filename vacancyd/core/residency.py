"""Residency proofs: when a follow-up request may be charged as reusing a loaded model.

A model that is already loaded no longer shows in free memory, so charging its whole load
requirement again would refuse its own follow-ups. The gate instead charges the upstream's
``resident_min_free_mib`` when the upstream's own observation proves the request will reuse
the model exactly as it is loaded. This module holds the per-adapter rules; the freshness
rules shared by every adapter (at most 4 s old, newer than the last job or yield) are in
:func:`vacancyd.core.gate.prove_residency`, which calls into here. See docs/footprints.md.

Ollama rules (:func:`prove_ollama`). The observation is ``GET /api/ps``; a request reuses a
listed model when

* the model is listed under its canonical name (Ollama's own matching rule);
* its ``expires_at`` parsed and is at least :data:`MIN_EXPIRY_S` away at decision time
  (Ollama unloads it then, and a past value means the runner is still busy or expiring);
* the request sets no load-time ("runner") option other than ``options.num_ctx``, and no
  ``shift`` (each would make Ollama reload the model);
* the loaded ``context_length`` is one the request is known to reuse: its explicit
  ``num_ctx`` equals it; or an earlier request of the same kind (digest, explicit or unset
  ``num_ctx``, ``/api`` or ``/v1``) was seen to load exactly it (the learned context map,
  which also covers servers whose parallel slots report a multiple of the per-slot
  context); or the request leaves ``num_ctx`` unset and the model's Modelfile sets it to the
  loaded context, unless a learned entry for that digest shows parallel slots.

Everything here is pure: times are arguments (seconds), nothing reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from vacancyd.core.reasons import Credit, CreditCode

#: A resident model must have at least this long before Ollama unloads it (seconds).
MIN_EXPIRY_S = 30.0

#: Ollama's load-time options (``api.Runner`` in ``api/types.go``, current and older
#: releases): a request that sets any of these, other than ``num_ctx``, may reload the model.
RUNNER_OPTIONS = frozenset(
    {
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "use_mmap",
        "use_mlock",
        "num_thread",
        "draft_num_predict",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "numa",
        "num_gqa",
        "rope_frequency_base",
        "rope_frequency_scale",
        "embedding_only",
    }
)

#: Request dialects the learned context map tells apart: Ollama's native routes and its
#: OpenAI-compatible shim (which cannot set ``num_ctx`` at all).
DIALECT_API = "api"
DIALECT_V1 = "v1"


def parse_expires_at(text: str) -> float:
    """Epoch seconds (wall clock) of an Ollama ``expires_at``.

    Ollama writes Go ``time.Time`` as RFC 3339 with up to nanosecond fractions and the
    server's local offset (``2024-06-04T14:38:31.83753-07:00``, ``...Z``), and a year near
    2318 for a model kept forever. Raises ValueError for anything without a date, a time and
    an offset.
    """
    if not isinstance(text, str) or "T" not in text.upper():
        raise ValueError(f"expires_at {text!r} is not an RFC 3339 timestamp")
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ValueError(f"expires_at {text!r} is not an RFC 3339 timestamp: {exc}") from None
    if when.tzinfo is None:
        raise ValueError(f"expires_at {text!r} has no UTC offset")
    return when.timestamp()


@dataclass(frozen=True, slots=True)
class ResidentModel:
    """One model an upstream reports loaded (Ollama ``/api/ps`` entry).

    ``name``: canonical name. ``size_mib`` / ``size_vram_mib``: total and on-GPU size in
    MiB (``size_vram_mib < size_mib`` means part of it spilled to system memory).
    ``context_length``: the loaded context in tokens (None on servers too old to report it).
    ``expires_in_s``: seconds from the observation until the server unloads it, None when
    ``expires_at`` could not be parsed (``expires_error`` says why).
    """

    name: str
    digest: str | None = None
    size_mib: float | None = None
    size_vram_mib: float | None = None
    context_length: int | None = None
    expires_in_s: float | None = None
    expires_error: str | None = None


@dataclass(frozen=True, slots=True)
class ContextKey:
    """A kind of request: model digest, explicit ``num_ctx`` (None when unset), dialect."""

    digest: str
    num_ctx: int | None
    dialect: str


@dataclass(frozen=True, slots=True)
class ContextLearning:
    """What an upstream has learned about its models' contexts (kept across restarts).

    ``contexts``: the context each kind of request was seen to load. ``modelfile_num_ctx``:
    per digest, the ``num_ctx`` its Modelfile sets (None: it sets none); a digest missing
    here has not been read yet.
    """

    contexts: Mapping[ContextKey, int] = field(default_factory=dict)
    modelfile_num_ctx: Mapping[str, int | None] = field(default_factory=dict)

    def shows_parallel_slots(self, digest: str) -> bool:
        """True when a learned explicit-``num_ctx`` entry loaded a multiple of what it asked."""
        return any(
            key.digest == digest and key.num_ctx is not None and ctx != key.num_ctx
            for key, ctx in self.contexts.items()
        )


def learn_context(
    contexts: Mapping[ContextKey, int], key: ContextKey, loaded: int
) -> dict[ContextKey, int]:
    """A copy of ``contexts`` recording that requests of kind ``key`` load ``loaded``."""
    out = dict(contexts)
    out[key] = loaded
    return out


def runner_options_in(options: Mapping[str, object] | None) -> tuple[str, ...]:
    """The load-time option names ``options`` sets, other than ``num_ctx``, sorted."""
    if not options:
        return ()
    return tuple(sorted(k for k in options if k in RUNNER_OPTIONS and k != "num_ctx"))


def find_model(models: Iterable[ResidentModel], name: str) -> ResidentModel | None:
    for model in models:
        if model.name == name:
            return model
    return None


def prove_ollama(
    *,
    model: ResidentModel | None,
    requested: str | None,
    num_ctx: int | None,
    runner_options: tuple[str, ...],
    dialect: str | None,
    learning: ContextLearning,
    age_s: float,
) -> Credit:
    """Decide whether an Ollama request reuses ``model`` as loaded (rules in the module doc).

    ``model``: the ``/api/ps`` entry for the requested name (None when not listed).
    ``age_s``: how old the observation is (seconds), subtracted from its expiry.
    """
    if requested is None:
        return Credit(False, "the request names no model", code=CreditCode.NO_MODEL)
    if model is None:
        return Credit(
            False, f"model {requested!r} is not loaded (not in /api/ps)", code=CreditCode.NOT_LOADED
        )
    if runner_options:
        return Credit(
            False,
            f"the request sets load-time option(s) {', '.join(runner_options)}, which make "
            "Ollama reload the model",
            code=CreditCode.RUNNER_OPTIONS,
        )
    if model.expires_in_s is None:
        return Credit(
            False,
            f"its expires_at could not be read ({model.expires_error})",
            code=CreditCode.EXPIRY_UNREADABLE,
        )
    left = model.expires_in_s - age_s
    if left < MIN_EXPIRY_S:
        return Credit(
            False,
            f"Ollama unloads it in {left:.1f} s (a credit needs at least {MIN_EXPIRY_S:.0f} s; "
            "a past expiry means the model is busy or being unloaded)",
            code=CreditCode.EXPIRING,
        )
    loaded = model.context_length
    if loaded is None:
        return Credit(
            False,
            "the server does not report the loaded context_length",
            code=CreditCode.CONTEXT_UNKNOWN,
        )
    return _prove_context(
        model,
        requested=requested,
        loaded=loaded,
        num_ctx=num_ctx,
        dialect=dialect,
        learning=learning,
    )


def _prove_context(
    model: ResidentModel,
    *,
    requested: str,
    loaded: int,
    num_ctx: int | None,
    dialect: str | None,
    learning: ContextLearning,
) -> Credit:
    """The context rule of :func:`prove_ollama` (module doc): whether a request with
    ``num_ctx`` (None: unset) reuses ``model``'s ``loaded`` context (tokens) as it is."""
    if num_ctx is not None and num_ctx == loaded:
        return Credit(
            True,
            f"{requested} is loaded with num_ctx {loaded} as requested",
            code=CreditCode.RESIDENT,
        )
    if model.digest is None:
        return Credit(
            False,
            "/api/ps gives no digest, so no learned context applies",
            code=CreditCode.CONTEXT_UNKNOWN,
        )
    kind = ContextKey(model.digest, num_ctx, dialect or DIALECT_API)
    learned = learning.contexts.get(kind)
    if learned is not None:
        if learned == loaded:
            return Credit(
                True,
                f"{requested} is loaded with context {loaded}, which this kind of request "
                "was seen to load",
                code=CreditCode.RESIDENT,
            )
        return Credit(
            False,
            f"{requested} is loaded with context {loaded}, but this kind of request loads "
            f"{learned} (Ollama would reload it)",
            code=CreditCode.CONTEXT_MISMATCH,
        )
    if num_ctx is None:
        modelfile = learning.modelfile_num_ctx.get(model.digest, -1)
        if modelfile == loaded and not learning.shows_parallel_slots(model.digest):
            return Credit(
                True,
                f"{requested} is loaded with its Modelfile's num_ctx {loaded}",
                code=CreditCode.RESIDENT,
            )
        if modelfile == -1:
            why = "its Modelfile has not been read yet"
        elif modelfile is None:
            why = "its Modelfile sets no num_ctx"
        elif modelfile == loaded:
            why = "parallel slots make the Modelfile's num_ctx no proof"
        else:
            why = f"its Modelfile sets num_ctx {modelfile}"
        return Credit(
            False,
            f"{requested} is loaded with context {loaded}; the request leaves num_ctx unset "
            f"and no request of its kind was seen to load that context ({why})",
            code=CreditCode.CONTEXT_UNKNOWN,
        )
    return Credit(
        False,
        f"{requested} is loaded with context {loaded}, the request asks for num_ctx {num_ctx}",
        code=CreditCode.CONTEXT_MISMATCH,
    )
