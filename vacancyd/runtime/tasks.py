"""Named, referenced, supervised background tasks (spec "API and metrics", last paragraph).

Every task is spawned here with a human name and marked essential or not. When an essential
task (a collector, the API listener, a proxy listener) ends for any reason other than the
daemon's own shutdown, the supervisor records the failure and wakes the daemon, which exits
nonzero rather than answer a misleading liveness check.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Supervisor:
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

    def _done(self, task: asyncio.Task[Any]) -> None:
        essential = self._tasks.pop(task, False)
        if self._stopping:
            return
        if task.cancelled():
            why = "was cancelled"
        elif (exc := task.exception()) is not None:
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
