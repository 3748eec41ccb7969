"""The upstream connection check: does the server behind a proxy listener accept connections?

One TCP connection to the upstream's ``target`` host and port, opened and closed at once,
per check: no HTTP request reaches the server, so it costs the inference server nothing
(the lendability probe itself never calls the upstream; it reads what this check last
found, see :mod:`vacancyd.core.reach`). The check runs only while someone asks the probe:
without a balancer probing, nobody reads its answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from yarl import URL

from vacancyd.core.observations import ProbeError


def target_address(target: URL) -> tuple[str, int]:
    """(host, port) of an upstream ``target`` URL: its port, else 443 for https, else 80.

    Raises ValueError for a URL without a host.
    """
    host = target.host
    if not host:
        raise ValueError(f"upstream target {target} has no host")
    port = target.port or (443 if target.scheme == "https" else 80)
    return host, port


async def connect_check(host: str, port: int) -> bool:
    """Open a TCP connection to ``host``:``port`` and close it; True when it opened.

    Raises :class:`ProbeError` naming the address and the failure when it did not. The
    caller bounds the time (``run_async_probe_loop``'s deadline).
    """
    try:
        _reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ProbeError(f"cannot connect to {host}:{port}: {reason}") from exc
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass  # the server hung up first: it accepted the connection, which is all we ask
    return True


async def run_reach_loop(
    host: str,
    port: int,
    *,
    interval_s: float,
    timeout_s: float,
    wanted: Callable[[], bool],
    wake: asyncio.Event,
    on_result: Callable[[bool, float, str], None],
) -> None:
    """Check ``host``:``port`` every ``interval_s`` seconds while ``wanted()``; otherwise
    wait for ``wake``. Each result goes to ``on_result(ok, started_monotonic, error)``.
    Runs until cancelled; raises nothing else."""
    while True:
        if not wanted():
            wake.clear()
            await wake.wait()
            continue
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                await connect_check(host, port)
        except TimeoutError:
            on_result(False, started, f"cannot connect to {host}:{port} within {timeout_s:g} s")
        except ProbeError as exc:
            on_result(False, started, str(exc))
        else:
            on_result(True, started, "")
        await asyncio.sleep(interval_s)
