"""A hot standby's state: the leader's, kept current by applying its WAL as it is written (`kvservice serve
--standby`). When the leader's lease lapses the standby takes leadership with a new epoch (the old leader is
fenced from then on), applies what is left of the WAL and serves: no snapshot to load, no tail to replay.

The follower applies the same commands through the same `Allocator.apply` as recovery does. A resync
barrier (the leader acknowledged mutations Redis never saw) or a WAL that went back (Redis lost its data)
means the WAL alone no longer describes the leader: it reloads from the next snapshot that covers it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvservice.allocator import Allocator
from kvservice.settings import AllocatorSettings
from kvservice.store import wal
from kvservice.store.recovery import recover
from kvservice.store.redis_store import RedisStore

logger = logging.getLogger(__name__)
CHUNK = 10_000  # WAL entries one read applies at most
RECONNECT_S = 2.0  # beyond its lease, what a leader gets to renew once Redis is back (see follow_until_lapse)


def _id(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq)


class Follower:
    def __init__(self, store: RedisStore, settings: AllocatorSettings) -> None:
        self.store = store
        self.allocator = Allocator(settings)
        self.last_id: bytes | None = None  # the last WAL entry applied
        self.consistent = False  # the state equals the leader's as of last_id
        self.applied = 0
        self.lag_entries = 0  # WAL entries the last poll found unapplied (at most one read's CHUNK)
        self.caught_up_at: float | None = None  # monotonic time it last had applied every entry it found
        self._snapshots_seen = -1

    async def load(self) -> bool:
        """(Re)builds the state from the snapshot and the WAL after it; False while a resync gap is unresolved."""
        self._snapshots_seen = await self.store.snapshots_committed()
        snapshot, covered, entries = await self.store.load()
        fresh = Allocator(self.allocator.settings)
        info = recover(fresh, snapshot, entries)
        self.allocator.state.replace(fresh.state)
        self.last_id = entries[-1][0] if entries else covered
        self.consistent = info["skipped_after_gap"] == 0
        if not self.consistent:
            # Replay stopped at the gap: only what precedes the barrier is applied.
            self.last_id = entries[info["replayed"] - 1][0] if info["replayed"] else covered
        return self.consistent

    async def catch_up(self) -> int:
        """Applies the WAL entries written since the last one applied; returns how many."""
        if not self.consistent:
            if await self.store.snapshots_committed() == self._snapshots_seen:
                return 0  # wait for a snapshot that covers the gap
            if not await self.load():
                return 0
        start = b"(" + self.last_id if self.last_id else b"-"
        chunk = await self.store.redis.xrange(self.store.k_wal, min=start, max="+", count=CHUNK)
        self.lag_entries = len(chunk)
        if not chunk:
            newest = await self.store.redis.xrevrange(self.store.k_wal, count=1)
            if self.last_id and (not newest or _id(newest[0][0]) < _id(self.last_id)):
                # The entry a snapshot covers stays in the stream: an emptier one means Redis lost its data.
                logger.warning("the WAL went back (Redis lost its data): reloading from the next snapshot")
                self.consistent = False
            else:
                self.caught_up_at = time.monotonic()
            return 0
        now = time.monotonic()
        settings = self.allocator.settings
        for entry_id, fields in chunk:
            raw = fields[b"e"]
            if wal.is_resync(raw):
                logger.info("resync barrier at %s: reloading once the snapshot covering it commits", entry_id)
                self.consistent = False
                return 0
            self.allocator.apply(wal.decode(raw, settings.hash_block_size), now)
            self.last_id = entry_id
            self.applied += 1
        if len(chunk) < CHUNK:
            self.caught_up_at = time.monotonic()
        return len(chunk)

    async def follow_until_lapse(self, lease_s: float, poll_s: float = 0.1) -> None:
        """Applies the WAL as it grows until the leader's lease has been absent for a grace period with Redis
        answering (a leader renews twice a second). After a Redis outage the lease has usually expired in
        Redis while the leader lives: it is given its whole lease plus RECONNECT_S (its client reconnecting,
        on a loaded machine) from Redis's return, so an outage alone never triggers a takeover."""
        grace = min(lease_s, 1.0)
        missing_since: float | None = None
        away, returned_at = False, float("-inf")
        while True:
            try:
                await self.catch_up()
                held = await self.store.lease_held()
            except Exception as exc:  # Redis away: wait for it (and for the leader to renew)
                logger.debug("follower: %r", exc)
                missing_since, away = None, True
                await asyncio.sleep(poll_s * 5)
                continue
            now = time.monotonic()
            if away:
                away, returned_at = False, now
            if held:
                missing_since = None
            elif missing_since is None:
                missing_since = now
            elif now >= max(missing_since + grace, returned_at + lease_s + RECONNECT_S) and self.consistent:
                return
            await asyncio.sleep(poll_s)
