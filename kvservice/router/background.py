"""A router part that runs a loop of its own on the event loop (health checks, event registration)."""

from __future__ import annotations

import asyncio
import contextlib


class Background:
    """`start()` runs the subclass's `_loop()` as a task; `stop()` cancels it and waits for it to end."""

    _task: asyncio.Task | None = None

    async def _loop(self) -> None:  # pragma: no cover - each part defines it
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
