"""Which asyncio event loop the daemon runs on.

uvloop (libuv underneath) runs aiohttp's server and client with noticeably less CPU per
request than the standard selector loop: docs/benchmarks.md has the side-by-side figures.
It is a default dependency on Linux and used whenever it can be imported; the standard loop
remains available, and is what runs where uvloop is missing (other platforms, a distribution
package without it).

The choice, in order: ``vacancyd run --event-loop``, then the ``VACANCYD_EVENT_LOOP``
environment variable, then ``auto``.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV = "VACANCYD_EVENT_LOOP"
CHOICES = ("auto", "asyncio", "uvloop")


class EventLoopError(ValueError):
    """An unknown event-loop name, or ``uvloop`` asked for where it is not installed."""


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def loop_factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """(name of the loop that will run, factory or None for the standard loop).

    ``choice`` is one of :data:`CHOICES`. Raises :class:`EventLoopError` for anything else,
    or for ``uvloop`` when it cannot be imported.
    """
    if choice not in CHOICES:
        raise EventLoopError(f"unknown event loop {choice!r} (one of {', '.join(CHOICES)})")
    if choice == "asyncio" or (choice == "auto" and not uvloop_available()):
        return "asyncio", None
    try:
        import uvloop
    except ImportError as exc:
        raise EventLoopError(
            f"event loop 'uvloop' was asked for but cannot be imported ({exc}); "
            "install it (pip install uvloop) or choose 'asyncio'"
        ) from exc
    return "uvloop", uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """Run ``main`` to completion on the chosen loop (like :func:`asyncio.run`).

    Raises :class:`EventLoopError` as :func:`loop_factory` does, before anything runs.
    """
    try:
        _, factory = loop_factory(choice)
    except EventLoopError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
