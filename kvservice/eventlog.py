"""The allocator's event log: every pool's cache events with one global sequence, kept for a
retained window so watchers can resume from any sequence inside it."""

from __future__ import annotations

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

    @property
    def tenant(self) -> str | None:
        """The tenant whose hashes the event carries (None: every tenant, e.g. AllBlocksCleared)."""
        if isinstance(self.event, AllBlocksCleared) or not self.event.block_hashes:
            return None
        return self.event.block_hashes[0][HASH_BYTES:].decode()


class EventLog:
    def __init__(self, retained: int = 100_000) -> None:
        if retained <= 0:
            raise ValueError(f"event retention must be positive, got {retained}")
        self.retained = retained
        self._events: deque[LoggedEvent] = deque(maxlen=retained)
        self.next_sequence = 1
        self.listeners: list[Callable[[], None]] = []

    def extend(self, pool_id: str, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        for event in events:
            self._events.append(LoggedEvent(self.next_sequence, pool_id, event))
            self.next_sequence += 1
        for notify in self.listeners:
            notify()

    @property
    def oldest_sequence(self) -> int:
        return self._events[0].sequence if self._events else self.next_sequence

    def since(self, start: int) -> Iterator[LoggedEvent]:
        """Events with sequence >= start. Raises OutOfRange when start fell out of the window."""
        oldest = self.oldest_sequence
        if start < oldest:
            raise OutOfRange(f"start_sequence {start} is older than the oldest retained event {oldest} "
                             f"(retention {self.retained} events); resume from {oldest} or later")
        if start >= self.next_sequence:
            return iter(())
        offset = start - oldest
        return (self._events[i] for i in range(offset, len(self._events)))
