"""The allocator's event log: every pool's cache events with one global sequence, kept for a
retained window so watchers can resume from any sequence inside it.

Events are stored per batch (one step's events of one pool), not one record per event: a step that
evicts a thousand blocks adds one list, which keeps the hot path cheap.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvservice.core.events import AllBlocksCleared, KVCacheEvent
from kvservice.errors import OutOfRange
from kvservice.hashing import HASH_BYTES


@dataclass(slots=True)
class LoggedEvent:
    sequence: int
    pool_id: str
    event: KVCacheEvent
    hash_bytes: int = HASH_BYTES  # the pool's hash length: the tenant follows it in every core hash

    @property
    def tenant(self) -> str | None:
        """The tenant whose hashes the event carries (None: every tenant, e.g. AllBlocksCleared)."""
        if isinstance(self.event, AllBlocksCleared) or not self.event.block_hashes:
            return None
        return self.event.block_hashes[0][self.hash_bytes:].decode()


class EventLog:
    def __init__(self, retained: int = 100_000) -> None:
        if retained <= 0:
            raise ValueError(f"event retention must be positive, got {retained}")
        self.retained = retained
        # (first sequence, pool, events, the pool's hash length)
        self._batches: deque[tuple[int, str, list[KVCacheEvent], int]] = deque()
        self._num_events = 0
        self.next_sequence = 1
        self.listeners: list[Callable[[], None]] = []

    def extend(self, pool_id: str, events: list[KVCacheEvent], hash_bytes: int = HASH_BYTES) -> None:
        if not events:
            return
        self._batches.append((self.next_sequence, pool_id, events, hash_bytes))
        self.next_sequence += len(events)
        self._num_events += len(events)
        while self._num_events - len(self._batches[0][2]) >= self.retained:
            self._num_events -= len(self._batches.popleft()[2])
        for notify in self.listeners:
            notify()

    @property
    def oldest_sequence(self) -> int:
        """The oldest sequence a watcher can resume from (whole batches are retained)."""
        return self._batches[0][0] if self._batches else self.next_sequence

    def since(self, start: int) -> Iterator[LoggedEvent]:
        """Events with sequence >= start. Raises OutOfRange when start fell out of the window, or lies past
        the next event (the sequence a watcher of new events starts from)."""
        oldest = self.oldest_sequence
        if start < oldest:
            raise OutOfRange(f"start_sequence {start} is older than the oldest retained event {oldest} "
                             f"(retention {self.retained} events); resume from {oldest} or later")
        if start > self.next_sequence:
            raise OutOfRange(f"start_sequence {start} is past the newest event {self.next_sequence - 1}; start at "
                             f"{self.next_sequence} (or omit it) to watch new events")
        if start == self.next_sequence:
            return iter(())
        batches = list(self._batches)
        first = bisect.bisect_right([b[0] for b in batches], start) - 1
        return self._iterate(batches[first:], start)

    @staticmethod
    def _iterate(batches, start: int) -> Iterator[LoggedEvent]:
        for first_seq, pool_id, events, hash_bytes in batches:
            for i in range(max(0, start - first_seq), len(events)):
                yield LoggedEvent(first_seq + i, pool_id, events[i], hash_bytes)
