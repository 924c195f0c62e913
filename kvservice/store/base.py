"""The journal interface the servicer writes through: the WAL when persistence is on, nothing when off.

States (an enum, one of them current): OFF (no persistence), OK (every acknowledged mutation is
recoverable), RESYNCING (Redis is back; mutations are logged again, but until the resync snapshot commits
a crash would lose what was acknowledged during the outage), DEGRADED (Redis is away: mutations are
acknowledged from memory), DOWN (Redis is away under --require-persistence: mutations are refused),
FENCED (a newer allocator took over: this one stops).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvservice.commands import Command


class PersistenceState(Enum):
    OFF = "off"
    OK = "ok"
    RESYNCING = "resyncing"
    DEGRADED = "degraded"
    DOWN = "down"
    FENCED = "fenced"


@dataclass(slots=True)
class JournalStats:
    entries: int = 0
    bytes: int = 0
    batches: int = 0
    snapshots: int = 0
    snapshot_failures: int = 0
    last_snapshot_bytes: int = 0
    last_snapshot_s: float = 0.0
    last_snapshot_at: float = 0.0  # time.time() of the last committed snapshot (0: none yet)
    wal_lag: int = 0
    append_seconds: float = 0.0  # summed Redis round-trip time of WAL appends (one per batch)
    redis_data_losses: int = 0  # times Redis answered without this allocator's leader key


class Journal:
    """Persistence off: mutations are acknowledged from memory (the base every journal extends)."""

    state = PersistenceState.OFF
    stats = JournalStats()
    leader_epoch = 0
    write_observer = None  # called with the seconds of each WAL append (metrics)

    def check_writable(self) -> None:
        """Raises Unavailable when a mutation must not be applied now."""
        return None

    async def record(self, command: Command) -> None:
        """Logs an applied command; returns once it is durable (or at once, when the state allows)."""
        return None

    def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


NullJournal = Journal
