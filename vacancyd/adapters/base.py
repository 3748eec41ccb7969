"""The adapter seam: what vacancyd knows about one kind of inference server.

An adapter is data plus two small functions: its route table (pure, in ``vacancyd.core``
terms), how to read the request facts (the model name) from a work request's body, and
optionally how to observe the server (for residency proofs). Adding a server kind means
adding one module and registering it in ``vacancyd.adapters.ADAPTERS``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import aiohttp
from yarl import URL

from vacancyd.adapters import bodyparse
from vacancyd.core.classify import Route, RouteTable
from vacancyd.core.reasons import ErrorCode
from vacancyd.core.snapshot import RequestFacts, ServerState

#: Body fields every adapter reads besides the route's model key.
_WANTED = frozenset({"background"})

Observe = Callable[[aiohttp.ClientSession, URL], Awaitable[ServerState]]
#: Builds a stateful observer for one upstream: (session, target, known Modelfile contexts
#: per digest) -> a callable taking one observation. Raises ProbeError when it cannot.
MakeObserver = Callable[
    [aiohttp.ClientSession, URL, Callable[[], Mapping[str, int | None]]],
    Callable[[], Awaitable[ServerState]],
]
#: Reads the runner facts of a work body: (route, payload) -> (num_ctx, runner options,
#: dialect); see RequestFacts.
ReadOptions = Callable[[Route, dict[str, Any] | None], tuple[int | None, tuple[str, ...], str]]


class UpstreamError(Exception):
    """A call vacancyd itself made to an upstream failed (unreachable, bad status, bad shape)."""


class Controller(Protocol):
    """What reclaim can do on one upstream server beyond refusing and cutting streams.

    See docs/reclaim.md. Built per upstream by ``Adapter.make_controller``. Every method
    that does I/O raises :class:`UpstreamError` on failure; callers bound it with a deadline.
    """

    #: True when the server's queue keeps borrowed work after the HTTP reply (ComfyUI), so
    #: it is cancelled through the server's API rather than by closing a connection.
    can_cancel: bool

    def prepare(self, route: Route, body: bytes) -> tuple[bytes, str | None]:
        """Rewrite a work body before forwarding; returns (body, tracked job key or None)."""
        ...

    def allows_result(self, route: Route, path: str) -> bool:
        """Whether a borrower-results read (``RouteClass.RESULTS``) names borrowed work."""
        ...

    async def wait_done(self, key: str) -> None:
        """Return once the server no longer runs or queues the tracked job ``key``."""
        ...

    async def cancel(self, keys: list[str]) -> str:
        """Cancel the tracked borrowed jobs ``keys``; returns a summary for the log."""
        ...

    async def unload(self, admitted: frozenset[str]) -> tuple[str, str]:
        """Hand the server's memory back; ``admitted``: job keys vacancyd admitted.

        Returns (outcome, detail): outcome ``unloaded`` or ``skipped`` (a metric label).
        """
        ...

    async def warm(self, model: str) -> str:
        """Load ``model`` again once lending resumes."""
        ...

    async def resident(self) -> list[str] | None:
        """Models the server holds in memory now, or None when it cannot tell.

        Exclusivity confirms an unload with it before forwarding an exclusive job.
        """
        ...


@runtime_checkable
class Waker(Protocol):
    """A controller whose reclaim can put the server to sleep (vLLM sleep mode): the proxy
    wakes it before forwarding a borrowed request."""

    async def ensure_awake(self) -> float | None:
        """Wake the server if vacancyd put it to sleep; the seconds it took, or None when it
        was awake. Raises :class:`UpstreamError` or TimeoutError."""
        ...


MakeController = Callable[[aiohttp.ClientSession, URL], Controller]


class BadRequest(Exception):
    """A work request's body could not be read the way the upstream reads it.

    ``code`` is a short machine-readable string for the JSON error.
    """

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST_BODY) -> None:
        super().__init__(message)
        self.code = code


def parse_json_body(
    body: bytes,
    content_type_header: str,
    keys: frozenset[str],
    whole: frozenset[str] = frozenset(),
) -> dict[str, Any] | None:
    """The top-level fields ``keys`` of a work body (see :func:`parse_json_body_steps`)."""
    return bodyparse.run(parse_json_body_steps(body, content_type_header, keys, whole))


def parse_json_body_steps(
    body: bytes,
    content_type_header: str,
    keys: frozenset[str],
    whole: frozenset[str] = frozenset(),
    exact: frozenset[str] = frozenset(),
) -> bodyparse.Steps[dict[str, Any] | None]:
    """The top-level fields ``keys`` of a work body, or None when the body is empty;
    objects and arrays are built only for the keys in ``whole``.

    Servers parse the body as JSON whatever its Content-Type says (llama-server, Ollama and
    vLLM do), so the proxy must too: a body is JSON unless it is ``multipart/form-data``,
    whose text fields are read instead. Only the wanted fields are built, at bounded cost
    and in pauseable steps (:mod:`vacancyd.adapters.bodyparse`). Raises :class:`BadRequest`
    for anything that is not a JSON object (including JSON nested too deeply to parse
    safely) or not valid multipart, and for a key spelled otherwise than one in ``exact``
    that a Go server's decoder would take for it (see ``Adapter.exact_keys``).
    """
    if not body or body.isspace():  # (isspace stops at the first other byte: no copy)
        return None
    mime = content_type_header.split(";", 1)[0].strip().lower()
    try:
        if mime == "multipart/form-data":
            return dict((yield from bodyparse.form_fields_steps(body, content_type_header, keys)))
        return (yield from bodyparse.json_fields_steps(body, keys, whole, exact))
    except bodyparse.BodyParseError as exc:
        raise BadRequest(str(exc)) from exc


def model_from(payload: dict[str, Any] | None, route: Route) -> str | None:
    """The model name at ``route.model_key``; raises BadRequest when it is not a string."""
    if payload is None or route.model_key is None:
        return None
    value = payload.get(route.model_key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{route.model_key!r} must be a string", ErrorCode.INVALID_MODEL)
    return value


@dataclass(frozen=True, slots=True)
class Adapter:
    """One kind of upstream server. ``observe`` is None when it has nothing to observe."""

    name: str
    table: RouteTable
    observe: Observe | None = None
    needs_model_observation: bool = False
    #: Builds the reclaim controller (unload, cancel) for servers that have one; None for
    #: servers that can only be refused (openai, llamacpp: docs/reclaim.md).
    make_controller: MakeController | None = None
    #: True when a closed connection does not prove the server stopped the work (an
    #: OpenAI-compatible server or llama-server may keep generating): a job a reclaim cut
    #: is then held in the ledger until evidence or an administrator releases it.
    cut_is_uncertain: bool = False
    #: True when the server may go on generating for a request whose client disconnected,
    #: and its observation (``ServerState.idle``) can show when it stopped (llama-server):
    #: such a job stays reserved, in ``tracking``, until the server is seen idle
    #: (``detached_work_timeout_s``; docs/footprints.md).
    detached_work: bool = False
    #: The server's own name rule, so a footprint listed as ``llama3.2`` matches a request
    #: for ``Llama3.2:latest`` when the server treats them as one model.
    canonical_model: Callable[[str], str] = str
    #: A stateful observer, for servers whose observation needs memory between polls
    #: (Ollama reads each model's Modelfile once per digest). Used instead of ``observe``.
    make_observer: MakeObserver | None = None
    #: Reads load-time options from a work body, for servers whose residency depends on them.
    read_options: ReadOptions | None = None
    #: Top-level body fields ``read_options`` reads, built in full (every other field is
    #: skipped unbuilt; see vacancyd.adapters.bodyparse).
    body_fields: frozenset[str] = frozenset()
    #: Path prefixes of the server's native routes whose errors are flat
    #: (``{"error": "<sentence>"}``, Ollama's ``/api/``): vacancyd's own errors and refusals
    #: on them take that shape (vacancyd.core.refusal), so the server's own client reads them.
    flat_error_prefixes: tuple[str, ...] = ()
    #: Rewrites a borrowed work body so it keeps its model loaded for at most the given
    #: seconds after it ends (Ollama's ``keep_alive``): (route, body, max seconds) -> the
    #: body to forward, in pauseable steps. None for servers without a keep-alive.
    cap_keep_alive: Callable[[Route, bytes, float], bodyparse.Steps[bytes]] | None = None
    #: Top-level body keys the server matches whatever their case (Go's encoding/json:
    #: ``"MODEL"`` and ``"Keep_Alive"`` are its ``model`` and ``keep_alive``, the last one
    #: given winning) and the proxy relies on. A work body must spell them exactly so:
    #: another spelling is a 400, as the server would read a model, context or keep-alive
    #: the gate never saw.
    exact_keys: frozenset[str] = frozenset()

    @property
    def observable(self) -> bool:
        """True when the daemon runs an observer for this server."""
        return self.observe is not None or self.make_observer is not None

    def read_facts(self, route: Route, body: bytes, content_type_header: str) -> RequestFacts:
        """Read the request facts from a buffered work body. Raises :class:`BadRequest`.

        ``content_type_header`` is the request's whole Content-Type header ("" if absent).
        """
        return bodyparse.run(self.read_facts_steps(route, body, content_type_header))

    def read_facts_steps(
        self, route: Route, body: bytes, content_type_header: str
    ) -> bodyparse.Steps[RequestFacts]:
        """:meth:`read_facts` in pauseable steps, for a large body read on the event loop
        (``bodyparse.run_cooperatively``). Raises :class:`BadRequest`."""
        keys = _WANTED | self.body_fields
        if route.model_key is not None:
            keys |= {route.model_key}
        payload = yield from parse_json_body_steps(
            body, content_type_header, keys, self.body_fields, self.exact_keys
        )
        if (
            payload is not None
            and payload.get("background") is True
            and route.pattern.endswith("/responses")
        ):
            raise BadRequest(
                "background Responses are not lent: their work outlives the reply that would "
                "release the reservation",
                ErrorCode.BACKGROUND_UNSUPPORTED,
            )
        model = model_from(payload, route)
        canonical = None if model is None else self.canonical_model(model)
        if self.read_options is None:
            return RequestFacts(model=canonical)
        num_ctx, options, dialect = self.read_options(route, payload)
        return RequestFacts(
            model=canonical, num_ctx=num_ctx, runner_options=options, dialect=dialect
        )
