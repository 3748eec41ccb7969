"""What the control layer needs from task supervision: a way to start a named background
task and say whether the daemon depends on it. The runtime's ``Supervisor`` provides it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol


class Spawner(Protocol):
    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, name: str, essential: bool
    ) -> asyncio.Task[Any]:
        """Start ``coro`` as a task named ``name``; ``essential``: its end stops the daemon."""
        ...
