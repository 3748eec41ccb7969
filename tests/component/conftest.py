"""Component-test fixtures: every async test here fails if the daemon blocks its event loop."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
from blockbuster import BlockBuster

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
