"""Component-test fixtures: every async test here fails if the daemon blocks its event loop."""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable, Iterator, Mapping

import pytest
from blockbuster import BlockBuster

from vacancyd.runtime.eventloop import uvloop_available

#: Where blocking calls on the loop are allowed: reading the configuration (which resolves
#: the time zone), and the daemon's start-up, which checks its state directory, reads saved
#: state and sets up tracing once, before any listener serves. (file, functions on the stack)
STARTUP = (
    ("vacancyd/config/load.py", frozenset({"parse_config", "load_config"})),
    ("vacancyd/runtime/daemon.py", frozenset({"__post_init__", "start"})),
    # prometheus_client's process collector reads /proc/self on each scrape: kernel
    # memory, not a disk, and bounded by the scrape rate.
    ("prometheus_client/process_collector.py", frozenset({"collect"})),
    # The system-memory collector samples on the loop: /proc/meminfo is kernel memory too.
    ("vacancyd/collectors/system.py", frozenset({"sample_memory"})),
)


@pytest.fixture(autouse=True)
def no_blocking_calls_on_the_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail an async test when vacancyd's code makes a blocking call (sleep, file or socket
    I/O, subprocess waits, lock acquisition...) on the event loop's thread.

    blockbuster raises ``BlockingError`` at the call, so the test fails where it blocked.
    Work vacancyd hands to executor threads is not affected, nor is the tests' own code
    (fakes writing scenario files), nor what the daemon does while it starts.
    Synchronous tests have no loop to block.
    """
    if not inspect.iscoroutinefunction(request.function):
        yield
        return
    buster = BlockBuster(["vacancyd"])
    for function in buster.functions.values():
        for filename, callers in STARTUP:
            function.can_block_in(filename, callers)
    buster.activate()
    try:
        yield
    finally:
        buster.deactivate()


# -- event loops ---------------------------------------------------------------------------

#: Modules whose tests run on both event loops: everything that speaks HTTP at the
#: connection level (the listeners' budgets and refusals, keep-alive, TLS, hostile clients,
#: forwarding, tunnels, drain and shutdown). The daemon runs on uvloop by default and the
#: two loops' transports differ (uvloop's is not an ``asyncio.Transport``), so a listener
#: rule tested on one loop only is not tested.
BOTH_LOOPS = frozenset(
    {
        "test_api",
        "test_comfyui",
        "test_drain",
        "test_forwarding_client",
        "test_forwarding_client_framing",
        "test_hostile_bodies",
        "test_hostile_clients",
        "test_identity",
        "test_keepalive",
        "test_proxy",
        "test_refusal_path",
        "test_shutdown",
        "test_supervision",
        "test_tls",
        "test_tls_trust",
        "test_tunnels",
        "test_upstream_connections",
    }
)
#: ``VACANCYD_TEST_EVENT_LOOPS=all`` runs every component test on both loops; ``asyncio``
#: or ``uvloop`` runs every one on that loop only.
LOOPS_ENV = "VACANCYD_TEST_EVENT_LOOPS"


def _loops() -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    loops: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {}
    if uvloop_available():
        import uvloop

        loops["uvloop"] = uvloop.new_event_loop
    loops["asyncio"] = asyncio.new_event_loop
    return loops


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The event loops an async component test runs on: both (uvloop, which the daemon
    runs on where it is installed, and asyncio's) for the modules in :data:`BOTH_LOOPS`,
    asyncio's for the rest; ``VACANCYD_TEST_EVENT_LOOPS`` overrides (``all``, ``asyncio``,
    ``uvloop``)."""
    loops = _loops()
    chosen = os.environ.get(LOOPS_ENV, "")
    if chosen in loops:
        return {chosen: loops[chosen]}
    module = getattr(item, "module", None)
    name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
    if chosen == "all" or name in BOTH_LOOPS:
        return loops
    return {"asyncio": loops["asyncio"]}
