"""Telling the allocator what the workers did (unpins, commits, frees), in a thread of its own: off the engine's
step, batched into one Step per store pool, and sent again until taken when they are safe to repeat."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from kvservice.ops import FreeOp, OpStatus, UnpinOp

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # unpins and frees the allocator did not take are sent again this much later
MAX_TRIES = 600


class Teller:
    """`tell(pool_id, ops)` queues; the thread sends what is queued as one Step per pool. `step(pool_id, ops)`
    is the caller's (it holds the client and its lock). A failed send is retried for the ops that are safe
    to repeat (unpins and frees: NOT_FOUND once done); a commit that failed becomes a plain free (its pages
    are not known to have been cached), so a pin or a page is never held forever."""

    def __init__(self, step: Callable[[str, list], list], name: str = "kvservice-connector") -> None:
        self._step = step
        self._name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._retry: list[tuple[float, int, str, list]] = []  # (when, tries, pool, ops)
        self.num_sent = self.num_failed = 0
        # Told of each Step sent: (pool, its ops, seconds from the oldest one's tell to the allocator's answer).
        self.on_sent: Callable[[str, list, float], None] | None = None

    def tell(self, pool_id: str, ops: list) -> None:
        if not ops:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((pool_id, ops, time.monotonic()))

    def _loop(self) -> None:
        stop = False
        while not stop:
            try:
                batch = [self._queue.get(timeout=RETRY_S if self._retry else None)]
            except queue.Empty:
                batch = []
            while True:  # everything queued meanwhile goes in one Step per pool
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            now = time.monotonic()
            due = [(tries, pool, ops) for when, tries, pool, ops in self._retry if when <= now]
            self._retry = [r for r in self._retry if r[0] > now]
            self._send([(pool, ops, 0, at) for pool, ops, at in (b for b in batch if b is not None)]
                       + [(pool, ops, tries, now) for tries, pool, ops in due])
            for _ in batch:
                self._queue.task_done()

    def _send(self, batch: list[tuple[str, list, int, float]]) -> None:
        by_pool: dict[str, tuple[list, int, float]] = {}
        for pool_id, ops, tries, at in batch:
            have, most, first = by_pool.get(pool_id, ([], 0, at))
            by_pool[pool_id] = (have + ops, max(most, tries), min(first, at))
        for pool_id, (ops, tries, first) in by_pool.items():
            try:
                results = self._step(pool_id, ops)
                self.num_sent += len(ops)
                if self.on_sent is not None:
                    self.on_sent(pool_id, ops, time.monotonic() - first)
                bad = [r for r in results if r.status not in (OpStatus.OK, OpStatus.NOT_FOUND)]
                if bad:
                    logger.warning("kvservice connector: %s refused %s", pool_id, bad[0].message)
            except Exception as exc:  # noqa: BLE001 - sent again later: a pin or page must not stay held
                self.num_failed += 1
                again = [op for op in ops if isinstance(op, (UnpinOp, FreeOp))]
                if again and tries + 1 < MAX_TRIES:
                    self._retry.append((time.monotonic() + RETRY_S, tries + 1, pool_id, again))
                if tries == 0:
                    logger.warning("kvservice connector: telling %s failed (%s: %s); trying again", pool_id,
                                   type(exc).__name__, exc)

    @property
    def idle(self) -> bool:
        return self._queue.unfinished_tasks == 0 and not self._retry

    def flush(self) -> None:
        """Waits until everything queued was sent once (tests, shutdown)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
