"""Refusal reasons, error codes, their Retry-After hints, and the gate's decision values.

Every reason and error code vacancyd emits is a member of an enum here, and nowhere else:
the gate's refusal reasons (:class:`Reason`), the ``error.type`` and ``error.code`` of the
errors it answers itself (:class:`ErrorType`, :class:`ErrorCode`), a residency proof's
reason (:class:`CreditCode`), which fresh sample could change a refusal (:class:`Refresh`),
why a job is held (:class:`HoldReason`), how a reclaim
ended (:class:`ReclaimOutcome`), why a GPU's power limit was not taken
(:class:`PowerLimitProblem`), the reasons of the
browser guards (:class:`GuardReason`) and the authenticator's outcomes
(:class:`AuthOutcome`), and the reasons only the Kubernetes publisher writes
(:class:`PublishReason`). The codes and retry hints are a wire contract
(docs/architecture.md, the gate): their string values appear verbatim in JSON bodies,
``/status``, metrics labels, Kubernetes conditions and logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Reason(StrEnum):
    """Why a borrowed request was refused. Values are the exact wire strings."""

    LENDING_DISABLED = "lending_disabled"
    OWNER_ACTIVE = "owner_active"
    RESOURCE_DISABLED = "resource_disabled"
    RESOURCE_UNMEASURED = "resource_unmeasured"
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    RESOURCE_PRESSURED = "resource_pressured"
    RESOURCE_BUSY = "resource_busy"
    BODY_BUDGET_EXHAUSTED = "body_budget_exhausted"
    RECLAIMED = "reclaimed"
    #: The lender is draining before it stops (SIGTERM): ask another lender, or this one
    #: again once it has restarted.
    SHUTTING_DOWN = "shutting_down"
    #: A job held on the resource could not be written to the state directory (full disk,
    #: read-only file system): until it is, a restart would forget the hold, so the resource
    #: lends nothing. The write is retried until it succeeds.
    STATE_WRITE_FAILED = "state_write_failed"
    #: The GPU is above its ``max_temperature_c``: no new borrowed work until it has cooled
    #: below its resume temperature (docs/configuration.md).
    GPU_TOO_HOT = "gpu_too_hot"
    #: The borrower used its ``daily_busy_s`` for the lender's local day (429, Retry-After
    #: until the quota resets at local midnight; docs/borrowers.md).
    QUOTA_EXHAUSTED = "quota_exhausted"
    #: The borrower already runs its ``max_concurrent`` jobs (429; docs/borrowers.md).
    BORROWER_BUSY = "borrower_busy"


class ErrorType(StrEnum):
    """The ``error.type`` of a JSON error vacancyd answers itself (OpenAI's error classes,
    plus ``no_vacancy`` for refusals and ``upstream_error`` for a failed upstream)."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_error"
    NOT_FOUND = "not_found_error"
    NOT_IMPLEMENTED = "not_implemented"
    UPSTREAM = "upstream_error"
    NO_VACANCY = "no_vacancy"
    SERVER = "server_error"  #: vacancyd itself cannot answer now (the usage ledger)


class ErrorCode(StrEnum):
    """The ``error.code`` of every JSON error that is not a gate refusal (those carry a
    :class:`Reason`). Values are the exact wire strings."""

    # authentication (both listeners)
    MISSING_TOKEN = "missing_token"
    INVALID_TOKEN = "invalid_token"
    INSUFFICIENT_SCOPE = "insufficient_scope"
    INVALID_LOGIN_TICKET = "invalid_login_ticket"
    # request bodies and routes on the proxy
    REQUEST_TOO_LARGE = "request_too_large"
    BODY_TIMEOUT = "body_timeout"
    BODY_IDLE = "body_idle"
    INVALID_REQUEST_BODY = "invalid_request_body"
    INVALID_MODEL = "invalid_model"
    BACKGROUND_UNSUPPORTED = "background_unsupported"
    MANAGEMENT_DENIED = "management_denied"
    #: 403: a ``[[borrower]]`` asked for an upstream outside its ``upstreams``
    UPSTREAM_NOT_ALLOWED = "upstream_not_allowed"
    UNRECOGNIZED_ROUTE = "unrecognized_route"
    UNKNOWN_RESULT = "unknown_result"
    WEBSOCKET_WORK_UNSUPPORTED = "websocket_work_unsupported"
    #: an upgrade on a route whose server offers no WebSocket (not a progress channel)
    WEBSOCKET_NOT_OFFERED = "websocket_not_offered"
    WEBSOCKET_TUNNELS_EXHAUSTED = "websocket_tunnels_exhausted"
    CONNECTION_LIMIT = "connection_limit"
    BODY_NOT_ALLOWED = "body_not_allowed"
    ENCODED_BODY_NOT_ALLOWED = "encoded_body_not_allowed"
    BAD_REQUEST = "bad_request"
    #: more than one ``Authorization`` header: which one counts would be a guess
    DUPLICATE_AUTHORIZATION = "duplicate_authorization"
    # browser guards (both listeners)
    HOST_NOT_ALLOWED = "host_not_allowed"
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"
    CROSS_SITE_REQUEST = "cross_site_request"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    # the upstream failed
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_PROTOCOL_ERROR = "upstream_protocol_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    WEBSOCKET_HANDSHAKE_REFUSED = "websocket_handshake_refused"
    # the API listener
    INVALID_BODY = "invalid_body"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HTTP_ERROR = "http_error"
    UNKNOWN_RESOURCE = "unknown_resource"
    NO_CONTROLS = "no_controls"
    UNKNOWN_UPSTREAM = "unknown_upstream"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_JOB = "unknown_job"
    TOO_MANY_SUBSCRIBERS = "too_many_subscribers"
    #: ``GET /usage``: the usage ledger cannot be read now (its error is in /status).
    USAGE_UNAVAILABLE = "usage_unavailable"


class CreditCode(StrEnum):
    """Why a residency proof did or did not apply (:class:`Credit` ``code``): the ``reason``
    label of ``vacancyd_residency_credits_total`` and ``residency.code`` in ``/status``."""

    #: Applied: the server reports the model loaded (with the context asked for) and idle.
    RESIDENT = "resident"
    #: Applied: memory the server's allocator holds and reuses is added back (ComfyUI).
    ALLOCATOR = "allocator"
    NO_PROOF = "no_proof"  #: the adapter has no way to prove residency
    UNOBSERVED = "unobserved"  #: the server has not been observed yet
    OBSERVATION_FAILED = "observation_failed"  #: the newest observation failed
    STALE = "stale"  #: the observation is too old to prove anything
    BUSY = "busy"  #: the server is processing other work
    NOT_LOADED = "not_loaded"  #: the model is not resident
    NOT_ONE_GPU = "not_one_gpu"  #: the allocator credit needs a server on exactly one GPU
    ALLOCATOR_EMPTY = "allocator_empty"  #: the allocator holds no memory to reuse
    NO_MODEL = "no_model"  #: the request names no model
    RUNNER_OPTIONS = "runner_options"  #: the request changes options that reload the model
    EXPIRY_UNREADABLE = "expiry_unreadable"  #: when the model unloads cannot be read
    EXPIRING = "expiring"  #: the model unloads too soon to count on it
    CONTEXT_UNKNOWN = "context_unknown"  #: the loaded context cannot be told
    CONTEXT_MISMATCH = "context_mismatch"  #: loaded with another context than requested
    #: A proof without a code (only a metrics label; never set by the gate).
    UNKNOWN = "unknown"


class HoldReason(StrEnum):
    """Why a job is held (``hold.reason`` in ``/status``, logs and the durable holds file)."""

    CUT_UNCERTAIN = "cut_uncertain"  #: a reclaim cut it; the server may still be working
    TRACKING_LOST = "tracking_lost"  #: the server's queue could no longer be read
    UPSTREAM_SILENT = "upstream_silent"  #: no byte from the server for its silence limit
    #: The borrower disconnected and the server still showed work in progress when
    #: ``detached_work_timeout_s`` ran out.
    DETACHED_WORK = "detached_work"


class JobOutcome(StrEnum):
    """How a borrowed job ended: the ``outcome`` label of ``vacancyd_jobs_total`` and the
    ``outcome`` field of the job's end log line."""

    #: The server finished the exchange (whatever HTTP status it answered) and any work it
    #: tracks past the reply.
    COMPLETED = "completed"
    #: The borrower went away (or stopped reading for ``write_stall_timeout_s``) before the
    #: reply ended.
    BORROWER_DISCONNECTED = "borrower_disconnected"
    #: The exchange with the server failed: unreachable, not HTTP, broken mid-reply, silent.
    UPSTREAM_FAILED = "upstream_failed"
    CUT = "cut"  #: a reclaim cut it, or the daemon's stop cut its exchange
    #: Admitted but never forwarded: the borrower left, or the request was refused, while
    #: the servers it is exclusive of were unloaded.
    NOT_FORWARDED = "not_forwarded"


class PowerLimitProblem(StrEnum):
    """Why the driver did not take a GPU's lending power limit (``power_limit.problem`` in
    ``/status``, docs/hardware-limits.md)."""

    NO_PERMISSION = "no_permission"  #: vacancyd does not run as root (NVML_ERROR_NO_PERMISSION)
    NOT_SUPPORTED = "not_supported"  #: the card has no settable limit
    OUT_OF_RANGE = "out_of_range"  #: outside the card's min/max (or the driver said so)
    #: any other failure: an NVML error (a lost GPU), or the original limit could not be
    #: written to the state directory first
    FAILED = "failed"


class ReclaimOutcome(StrEnum):
    """How a reclaim ended (``reclaim.outcome`` in ``/status``, the ``outcome`` label of
    ``vacancyd_reclaims_total``)."""

    STOOD_DOWN = "stood_down"  #: the trigger cleared before the deadline
    WORK_ENDED = "work_ended"  #: nothing was left to cut
    CANCELLED = "cancelled"  #: work was cut at the deadline
    TIMED_OUT = "timed_out"  #: finish mode's completion timeout passed


class GuardReason(StrEnum):
    """The ``reason`` label of ``vacancyd_request_guard_refusals_total``: which browser
    guard refused a request (the JSON error carries the matching :class:`ErrorCode`)."""

    HOST_NOT_ALLOWED = ErrorCode.HOST_NOT_ALLOWED.value
    ORIGIN_NOT_ALLOWED = ErrorCode.ORIGIN_NOT_ALLOWED.value
    CROSS_SITE_REQUEST = ErrorCode.CROSS_SITE_REQUEST.value
    #: An admin body that is not JSON (``ErrorCode.UNSUPPORTED_MEDIA_TYPE``).
    CONTENT_TYPE = "content_type"


class AuthOutcome(StrEnum):
    """The ``outcome`` label of ``vacancyd_auth_total``."""

    ALLOWED = "allowed"
    MISSING = "missing"  #: no bearer token
    INVALID = "invalid"  #: a token that matches none
    FORBIDDEN = "forbidden"  #: a valid token without the scope
    HOST_NOT_ALLOWED = ErrorCode.HOST_NOT_ALLOWED.value  #: trusted without a token, wrong Host
    DUPLICATE = "duplicate"  #: more than one Authorization header


class PublishReason(StrEnum):
    """Reasons the Kubernetes publisher writes beside the gate's :class:`Reason` (an
    upstream's ``reason`` in the published state, CamelCased in ``VacancyLendable``)."""

    #: Lendable again, but not yet for ``lendable_stable_s``: published not lendable.
    SETTLING = "settling"
    #: A /status document says an upstream is not lendable but gives no reason.
    UNKNOWN = "unknown"


#: Default Retry-After (seconds) per reason. Gate steps that share a reason but differ in
#: urgency (``owner_active`` is 5, 30 or 120 s) pass their own value instead.
RETRY_AFTER_S: dict[Reason, int] = {
    Reason.LENDING_DISABLED: 300,
    Reason.OWNER_ACTIVE: 120,
    Reason.RESOURCE_DISABLED: 300,
    Reason.RESOURCE_UNMEASURED: 30,
    Reason.INSUFFICIENT_CAPACITY: 30,
    Reason.RESOURCE_PRESSURED: 30,
    Reason.RESOURCE_BUSY: 2,
    Reason.BODY_BUDGET_EXHAUSTED: 2,
    Reason.RECLAIMED: 30,
    Reason.SHUTTING_DOWN: 10,
    Reason.STATE_WRITE_FAILED: 30,
    Reason.GPU_TOO_HOT: 60,
    Reason.QUOTA_EXHAUSTED: 3600,  # the rule passes the seconds until the quota resets
    Reason.BORROWER_BUSY: 2,
}

#: Refusals answered with their own HTTP status whatever the upstream's ``refusal_status``:
#: a borrower's own limits are its doing (429 Too Many Requests), not the lender's state.
#: Their Retry-After is never capped by ``retry_after_max_s`` (it says when the quota resets).
BORROWER_LIMITS: dict[Reason, int] = {Reason.QUOTA_EXHAUSTED: 429, Reason.BORROWER_BUSY: 429}


class Refresh(StrEnum):
    """Which fresh sample could change a refusal (:attr:`Refuse.refresh`): admission waits
    for that sample and decides once more, and a waiting request keeps waiting through the
    refusal. Never rendered on the wire."""

    #: A new observation of the upstream's server (key ``server:NAME``): a stale or missing
    #: observation, or a residency proof that failed only for the observation's age.
    SERVER = "server"
    #: A capacity sample of the refusal's resource taken after its last release.
    CAPACITY = "capacity"


@dataclass(frozen=True, slots=True)
class Credit:
    """Outcome of a residency proof (docs/architecture.md step 6).

    ``applied`` is True when the model was proved resident and the smaller
    ``resident_min_free_mib`` was charged. ``why`` says why a credit did or did not apply;
    ``failed_only_for_age`` marks a proof that would have passed with a fresher observation,
    which lets the proxy take one fresh observation and decide again.
    ``added_mib``: for servers whose credit is memory they hold and reuse (ComfyUI's
    allocator), the MiB added back to free memory instead of shrinking the charge.
    """

    applied: bool
    why: str
    failed_only_for_age: bool = False
    added_mib: float = 0.0
    #: A short stable code for metrics labels: a :class:`CreditCode` value.
    code: str = ""


@dataclass(frozen=True, slots=True)
class Admit:
    """The gate admits the request.

    ``resources`` lists the resources the ledger must reserve (primary first).
    ``charged_mib`` is what the per-model step charged against the primary resource, or
    None when it has no byte capacity.
    """

    resources: tuple[str, ...]
    charged_mib: int | None = None
    credit: Credit | None = None


@dataclass(frozen=True, slots=True)
class Refuse:
    """The gate (or ledger) refuses the request.

    ``retry_after_s`` is whole seconds for the Retry-After header. ``detail`` is a sentence
    for a person; ``resource`` names the resource a per-resource step refused on.
    ``extra``: fields the refusal body carries (an owner hold's ``hold`` and ``until``).
    ``refresh``: the fresh sample that could change this refusal, None when none could.
    """

    reason: Reason
    retry_after_s: int
    detail: str
    resource: str | None = None
    credit: Credit | None = None
    extra: dict[str, object] = field(default_factory=dict)
    refresh: Refresh | None = None

    @classmethod
    def of(cls, reason: Reason, detail: str, **kw: object) -> Refuse:
        """Build a refusal with the reason's default Retry-After."""
        retry = kw.pop("retry_after_s", RETRY_AFTER_S[reason])
        assert isinstance(retry, int)
        return cls(reason=reason, retry_after_s=retry, detail=detail, **kw)  # type: ignore[arg-type]


Decision = Admit | Refuse
