"""Request classification against an adapter's route table (docs/architecture.md).

A borrower reaches only the routes an adapter lists. Paths are matched exactly, segment by
segment, after dot segments are resolved the way the forwarded URL would resolve them, and
a listed segment must match both as sent and percent-decoded: ``/%73lots`` is not ``/slots``
and ``/v1/models/..%2Fapi%2Fps`` is not a model id. Anything ambiguous is unrecognized, and
unrecognized requests are refused by the proxy (403 for GET/HEAD, 501 otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import unquote


class RouteClass(StrEnum):
    WORK = "work"  #: inference: gated, body buffered for the model name, ledger reserved
    PASSTHROUGH = "passthrough"  #: discovery and health: forwarded while lending is off
    RESULTS = "results"  #: a borrower's own results (ComfyUI history, view, ws)
    MANAGEMENT = "management"  #: owner activity or server administration
    UNRECOGNIZED = "unrecognized"


PARAM = "{}"


@dataclass(frozen=True, slots=True)
class Route:
    """One listed route. ``pattern`` is the path; a ``{}`` segment matches one segment.

    ``no_query``: a query string turns this read into management (health checks need none).
    ``model_key``: the JSON body field the upstream reads the model name from, if any.
    ``websocket``: the server offers a WebSocket here that the borrower keeps whatever the
    gate says (a progress channel such as ComfyUI's ``/ws``), so an upgrade is tunneled;
    an upgrade on any other route is refused.
    """

    methods: frozenset[str]
    pattern: str
    klass: RouteClass
    no_query: bool = False
    model_key: str | None = "model"
    websocket: bool = False

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(self.pattern.split("/")[1:])


def route(methods: str, pattern: str, klass: RouteClass, **kw: object) -> Route:
    """Shorthand: ``route("GET HEAD", "/v1/models", RouteClass.PASSTHROUGH)``."""
    return Route(frozenset(methods.split()), pattern, klass, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class RouteTable:
    name: str
    routes: tuple[Route, ...]

    def extend(self, name: str, *routes: Route) -> RouteTable:
        """A new table with ``routes`` listed before this one's (so they take precedence)."""
        return RouteTable(name, (*routes, *self.routes))

    def borrower_reads(self) -> list[str]:
        """The GET routes a borrower may use, for the ``management_denied`` refusal."""
        return sorted(
            {
                r.pattern
                for r in self.routes
                if "GET" in r.methods and r.klass in (RouteClass.PASSTHROUGH, RouteClass.RESULTS)
            }
        )


@dataclass(frozen=True, slots=True)
class Classification:
    """Result of :func:`classify`. ``path`` is the dot-resolved raw path to forward."""

    klass: RouteClass
    path: str
    route: Route | None = None
    why: str = ""


def remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 dot-segment removal on a raw (still percent-encoded) path."""
    output: list[str] = []
    segments = path.split("/")
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == ".":
            if last:
                output.append("")
            continue
        if seg == "..":
            if len(output) > 1:
                output.pop()
            if last:
                output.append("")
            continue
        output.append(seg)
    result = "/".join(output)
    if not result.startswith("/"):
        result = "/" + result
    return result


def _decoded_segments(path: str) -> tuple[str, ...] | None:
    segments = tuple(path.split("/")[1:])
    decoded = []
    for seg in segments:
        plain = unquote(seg, errors="strict") if "%" in seg else seg
        if "/" in plain or plain in (".", "..") or "\x00" in plain or "\\" in plain:
            return None
        decoded.append(plain)
    return tuple(decoded)


def _matches(pattern: tuple[str, ...], raw: tuple[str, ...], decoded: tuple[str, ...]) -> bool:
    if len(pattern) != len(raw):
        return False
    for want, got_raw, got in zip(pattern, raw, decoded, strict=True):
        if want == PARAM:
            if not got:
                return False
        elif want != got_raw or want != got:
            return False
    return True


def classify(method: str, raw_path: str, query: str, table: RouteTable) -> Classification:
    """Classify a request by method and raw path (no query) against ``table``.

    ``HEAD`` matches wherever ``GET`` is listed. Returns UNRECOGNIZED with a reason when no
    route matches exactly.
    """
    if not raw_path.startswith("/"):
        return Classification(RouteClass.UNRECOGNIZED, raw_path, why="path is not absolute")
    path = remove_dot_segments(raw_path)
    try:
        decoded = _decoded_segments(path)
    except UnicodeDecodeError:
        decoded = None
    if decoded is None:
        return Classification(
            RouteClass.UNRECOGNIZED, path, why="path has encoded separators or dot segments"
        )
    raw = tuple(path.split("/")[1:])
    method = method.upper()
    for candidate in table.routes:
        if not _matches(candidate.segments, raw, decoded):
            continue
        methods = candidate.methods | ({"HEAD"} if "GET" in candidate.methods else set())
        if method not in methods:
            continue
        klass = candidate.klass
        if candidate.no_query and query:
            klass = RouteClass.MANAGEMENT
        return Classification(klass, path, candidate)
    return Classification(RouteClass.UNRECOGNIZED, path, why="route is not listed")


class Classifier:
    """:func:`classify` against one route table, remembering recent answers.

    Borrowers repeat the same few paths; classifying one costs more than the rest of a
    refusal. The answer depends on the method, the raw path and only whether a query is
    present (``no_query`` routes), so that is the key. At most ``max_entries`` answers are
    kept; past that the oldest is forgotten, so varied paths cannot grow it.
    """

    def __init__(self, table: RouteTable, max_entries: int = 1024) -> None:
        self.table = table
        self.max_entries = max_entries
        self._seen: dict[tuple[str, str, bool], Classification] = {}

    def __call__(self, method: str, raw_path: str, query: str) -> Classification:
        key = (method, raw_path, bool(query))
        found = self._seen.get(key)
        if found is None:
            found = classify(method, raw_path, query, self.table)
            if len(self._seen) >= self.max_entries:
                del self._seen[next(iter(self._seen))]
            self._seen[key] = found
        return found
