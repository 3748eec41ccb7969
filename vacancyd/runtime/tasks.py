"""Named, referenced, supervised background tasks (docs/architecture.md, "Supervision and
shutdown").

Every background task of the daemon (one that outlives the call that started it) is
spawned here with a human name and marked essential or not; the lower layers get
:meth:`Supervisor.spawn` passed in (``vacancyd.control.spawn.Spawner``, or a
``spawn(coro, name)`` callable). When an essential task (a collector, the API listener, a
proxy listener) ends for any reason other than the daemon's own shutdown, the supervisor
records the failure and wakes the daemon, which exits nonzero rather than answer a
misleading liveness check.

Tasks that live only inside the call that created them and are awaited there (a
WebSocket tunnel's two pumps, the ``/events`` queue wait, :meth:`Daemon.wait`'s two
waiters) are named but not supervised: their caller owns them and ends them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class ListenerClosed(RuntimeError):
    """A listening socket stopped accepting connections while the daemon was running."""


async def hold_listener(name: str, server: asyncio.AbstractServer) -> None:
    """Run as long as ``server`` accepts connections; raises :class:`ListenerClosed` when it
    stops for any reason other than this task being cancelled. Spawned as an essential task
    per listener, so a listener that dies stops the daemon with a nonzero exit."""
    loop = asyncio.get_running_loop()
    # asyncio's serve_forever ends (cancelled) when the server closes; uvloop's never does,
    # so the server's closing is awaited beside it and whichever ends first counts.
    serving = loop.create_task(server.serve_forever())
    closed = loop.create_task(server.wait_closed())
    try:
        await asyncio.wait((serving, closed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in (serving, closed):
            waiter.cancel()
    raise ListenerClosed(f"{name} stopped accepting connections")


class Supervisor:
    """Owns every background task: a name, a strong reference and whether it is essential.

    An essential task that ends (returns, raises or is cancelled) before :meth:`stopping`
    or :meth:`stop` was called sets :attr:`failed` with the reason in :attr:`failure`.
    """

    def __init__(self) -> None:
        self._tasks: dict[asyncio.Task[Any], bool] = {}
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self._stopping = False

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, name: str, essential: bool
    ) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks[task] = essential
        task.add_done_callback(self._done)
        return task

    def running(self) -> dict[str, bool]:
        """Name -> essential for every task still running."""
        return {task.get_name(): essential for task, essential in self._tasks.items()}

    def tasks(self) -> dict[asyncio.Task[Any], bool]:
        """Every task still running -> essential (a copy)."""
        return dict(self._tasks)

    def stopping(self) -> None:
        """The daemon is shutting down: tasks that end from here on are not failures."""
        self._stopping = True

    def _done(self, task: asyncio.Task[Any]) -> None:
        essential = self._tasks.pop(task, False)
        exc = None if task.cancelled() else task.exception()  # retrieved even when stopping
        if self._stopping:
            return
        if task.cancelled():
            why = "was cancelled"
        elif exc is not None:
            why = f"failed: {exc!r}"
            log.error("task %r %s", task.get_name(), why, exc_info=exc)
        else:
            why = "exited"
        if essential:
            log.critical("essential task %r %s; vacancyd stops", task.get_name(), why)
            if self.failure is None:
                self.failure = f"essential task {task.get_name()!r} {why}"
            self.failed.set()

    async def stop(self) -> None:
        """Cancel every task and wait for them (bounded by each task's own cleanup)."""
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
