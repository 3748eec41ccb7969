"""Probe loops: each collector samples on its own cadence, off the event loop, with a deadline.

A synchronous probe (psutil, pynvml) runs in the collector's own single-thread executor under
``asyncio.timeout``. If it overruns, the sample is recorded as failed (unknown quality) and
the stuck call is left to finish in its thread: the loop skips samples until it does, so one
slow probe can never stall another collector or the presence loop (docs/architecture.md).
Samples are stamped with the :func:`time.monotonic` time at which the probe *started*, so a
sample is never credited as newer than it is: the ledger's post-completion rule (a sample
taken after the last release) relies on it, and uvloop's own loop clock is too coarse for
that (see :mod:`vacancyd.state`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from vacancyd.core.observations import ProbeError, ProbeFailure

T = TypeVar("T")
log = logging.getLogger(__name__)
#: Counts one failed sample by kind (``vacancyd_collector_errors_total``).
CountFailure = Callable[[ProbeFailure], None]


def _count(count: CountFailure | None, kind: ProbeFailure) -> None:
    if count is not None:
        count(kind)


async def _wait(wake: asyncio.Event | None, interval_s: float) -> None:
    if wake is None:
        await asyncio.sleep(interval_s)
        return
    try:
        async with asyncio.timeout(interval_s):
            await wake.wait()
    except TimeoutError:
        pass
    wake.clear()


async def run_probe_loop(
    name: str,
    probe: Callable[[], T],
    *,
    interval_s: float,
    timeout_s: float,
    on_sample: Callable[[T, float], object],
    on_error: Callable[[str, float], object],
    wake: asyncio.Event | None = None,
    count: CountFailure | None = None,
) -> None:
    """Sample ``probe`` forever in a dedicated thread. Never returns; cancel to stop.
    Every failed sample goes to ``on_error`` (its message) and to ``count`` (its kind)."""
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"probe-{name}")
    stuck: asyncio.Future[T] | None = None
    try:
        while True:
            started = time.monotonic()
            if stuck is not None and not stuck.done():
                on_error(f"previous probe still running past its {timeout_s:g} s deadline", started)
                _count(count, ProbeFailure.STUCK)
            else:
                stuck = None
                future = loop.run_in_executor(executor, probe)
                try:
                    async with asyncio.timeout(timeout_s):
                        value = await asyncio.shield(future)
                except TimeoutError:
                    stuck = future
                    on_error(f"probe exceeded its {timeout_s:g} s deadline", started)
                    _count(count, ProbeFailure.TIMEOUT)
                except ProbeError as exc:
                    on_error(str(exc), started)
                    _count(count, ProbeFailure.FAILED)
                except Exception as exc:  # a probe bug must not kill the collector
                    log.exception("probe %s failed unexpectedly", name)
                    on_error(f"probe failed: {exc!r}", started)
                    _count(count, ProbeFailure.UNEXPECTED)
                else:
                    on_sample(value, started)
            await _wait(wake, interval_s)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def sample_now(
    name: str,
    probe: Callable[[], T],
    *,
    on_sample: Callable[[T, float], object],
    on_error: Callable[[str, float], object],
    count: CountFailure | None = None,
) -> Callable[[], None]:
    """A call that samples ``probe`` at once, on the calling thread, and records the result
    (stamped with the :func:`time.monotonic` time it started). Only for a probe that cannot
    block the event loop (see ``OnDemandSamples.inline`` (vacancyd.samples))."""

    def sample() -> None:
        started = time.monotonic()
        try:
            value = probe()
        except ProbeError as exc:
            on_error(str(exc), started)
            _count(count, ProbeFailure.FAILED)
        except Exception as exc:  # a probe bug must not break the loop callback
            log.exception("probe %s failed unexpectedly", name)
            on_error(f"probe failed: {exc!r}", started)
            _count(count, ProbeFailure.UNEXPECTED)
        else:
            on_sample(value, started)

    return sample


async def run_inline_probe_loop(sample: Callable[[], None], *, interval_s: float) -> None:
    """Call ``sample`` (from :func:`sample_now`) every ``interval_s`` seconds on the loop;
    the samples asked for in between are taken by ``OnDemandSamples.inline``
    (vacancyd.samples). Never returns."""
    while True:
        sample()
        await asyncio.sleep(interval_s)


async def run_async_probe_loop(
    name: str,
    probe: Callable[[], Awaitable[T]],
    *,
    interval_s: float,
    timeout_s: float,
    on_sample: Callable[[T, float], None],
    on_error: Callable[[str, float], None],
    wake: asyncio.Event | None = None,
    count: CountFailure | None = None,
) -> None:
    """Like :func:`run_probe_loop` for an async probe (an HTTP call to an upstream)."""
    while True:
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                value = await probe()
        except TimeoutError:
            on_error(f"probe exceeded its {timeout_s:g} s deadline", started)
            _count(count, ProbeFailure.TIMEOUT)
        except ProbeError as exc:
            on_error(str(exc), started)
            _count(count, ProbeFailure.FAILED)
        except Exception as exc:
            log.exception("probe %s failed unexpectedly", name)
            on_error(f"probe failed: {exc!r}", started)
            _count(count, ProbeFailure.UNEXPECTED)
        else:
            on_sample(value, started)
        await _wait(wake, interval_s)


__all__ = [
    "CountFailure",
    "ProbeError",
    "ProbeFailure",
    "run_async_probe_loop",
    "run_inline_probe_loop",
    "run_probe_loop",
    "sample_now",
]
