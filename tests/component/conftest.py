"""Component-test fixtures: every async test here fails if the daemon blocks its event loop."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
from blockbuster import BlockBuster

#: Where file-system calls on the loop are allowed: reading the configuration (which
#: resolves the time zone), and the daemon's start-up, which checks its state directory and
#: reads saved state once, before any listener serves. (file, functions on the call stack)
STARTUP = (
    ("vacancyd/config/load.py", frozenset({"parse_config", "load_config"})),
    ("vacancyd/runtime/daemon.py", frozenset({"__post_init__", "start"})),
)


@pytest.fixture(autouse=True)
def no_blocking_calls_on_the_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail an async test when vacancyd's code makes a blocking call (sleep, file or socket
    I/O, subprocess waits, lock acquisition...) on the event loop's thread.

    blockbuster raises ``BlockingError`` at the call, so the test fails where it blocked.
    Work vacancyd hands to executor threads is not affected, nor is the tests' own code
    (fakes writing scenario files), nor file-system calls made while the daemon starts.
    Synchronous tests have no loop to block.
    """
    if not inspect.iscoroutinefunction(request.function):
        yield
        return
    buster = BlockBuster(["vacancyd"])
    for name, function in buster.functions.items():
        if name.startswith(("os.", "io.")):
            for filename, callers in STARTUP:
                function.can_block_in(filename, callers)
    buster.activate()
    try:
        yield
    finally:
        buster.deactivate()
