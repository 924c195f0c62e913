"""Restart = load the snapshot + `apply` the WAL's commands after it, through the same code that applied
them live (the allocator is deterministic, so the rebuilt state equals the lost one)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from kvservice.allocator import Allocator
from kvservice.commands import Barrier
from kvservice.store import wal
from kvservice.store.snapshot import dump
from kvservice.store.snapshot import load as load_snapshot

logger = logging.getLogger(__name__)
GAP_WRITER = "recovery"  # the pending-snapshot slot of a snapshot written to close a gap


def recover(allocator: Allocator, snapshot: bytes | None, entries: Iterable[tuple[bytes, bytes]]) -> dict:
    """Rebuilds `allocator` (fresh) from the snapshot and the WAL entries after it.

    A resync barrier the snapshot does not cover marks a gap (mutations acknowledged while Redis was
    down were never logged): replay stops there and what follows is treated as lost, so clients that
    saw those acknowledgements get a new pool epoch on reconnect instead of stale blocks.
    """
    start = time.perf_counter()
    now = time.monotonic()
    if snapshot is not None:
        load_snapshot(snapshot, allocator, now)
    replayed = skipped = 0
    gap = False
    hash_block_size = allocator.settings.hash_block_size
    for _, raw in entries:
        if not gap and wal.is_resync(raw):
            gap = True
        if gap:
            skipped += 1
            continue
        allocator.apply(wal.decode(raw, hash_block_size), now)
        replayed += 1
    allocator.state.sessions.restart_leases(time.monotonic())
    info = {"snapshot_bytes": len(snapshot or b""), "replayed": replayed, "skipped_after_gap": skipped,
            "seconds": time.perf_counter() - start}
    if gap:
        logger.warning("WAL has a gap (acknowledged while Redis was down and never resynced): %d entries after it "
                       "were not replayed; clients that saw them will get new pool epochs", skipped)
    return info


async def close_gap(store, allocator: Allocator) -> None:
    """After a recovery that stopped at a gap, and before anything is served: the recovered state becomes the
    snapshot, covering the gap. Left in the WAL, the gap would make the next recovery skip everything logged
    after it, so whatever this allocator acknowledged would be lost at its next crash."""
    (barrier_id,) = await store.append([wal.encode(Barrier())])
    await store.write_pending(GAP_WRITER, dump(allocator))
    await store.commit_snapshot(barrier_id, GAP_WRITER)
    logger.warning("the recovered state (up to the WAL's gap) is committed as the snapshot, covering the gap, "
                   "before serving")
