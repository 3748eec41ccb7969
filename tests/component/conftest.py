"""Component-test fixtures: every async test here fails if the daemon blocks its event loop."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
from blockbuster import BlockBuster

#: Reads the daemon makes once while it starts, before any listener serves: the time zone,
#: saved calibrations, the owner's saved pause, and whether kubernetes_asyncio imports.
#: (file, functions) -> the blocking calls allowed under them.
STARTUP_READS = {
    ("vacancyd/config/zone.py", frozenset({"local_zone", "zone_by_name"})),
    ("vacancyd/runtime/calibration.py", frozenset({"load_calibrations"})),
    ("vacancyd/control/owner.py", frozenset({"_load_pause"})),
    ("vacancyd/k8s/client.py", frozenset({"available"})),
}
READS = (
    "os.stat",
    "os.getcwd",
    "os.access",
    "os.path.abspath",
    "os.path.islink",
    "os.readlink",
    "os.listdir",
    "os.scandir",
    "os.read",
    "io.BufferedReader.read",
    "io.TextIOWrapper.read",
)


@pytest.fixture(autouse=True)
def no_blocking_calls_on_the_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail an async test when vacancyd's code makes a blocking call (sleep, file or socket
    I/O, subprocess waits, lock acquisition...) on the event loop's thread.

    blockbuster raises ``BlockingError`` at the call, so the test fails where it blocked.
    Work vacancyd hands to executor threads is not affected, nor is the tests' own code
    (fakes writing scenario files), nor the start-up reads above. Synchronous tests have no
    loop to block.
    """
    if not inspect.iscoroutinefunction(request.function):
        yield
        return
    buster = BlockBuster(["vacancyd"])
    for filename, callers in STARTUP_READS:
        for function in READS:
            buster.functions[function].can_block_in(filename, callers)
    buster.activate()
    try:
        yield
    finally:
        buster.deactivate()
