"""Restart = load the snapshot + replay the WAL after it, through the same allocator code paths that
produced the entries (the allocator is deterministic, so the rebuilt state equals the lost one)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import state_pb2 as st
from kvservice.allocator import Allocator
from kvservice.store.snapshot import load as load_snapshot
from kvservice.wire import decode_pool_spec, ops_from_request

logger = logging.getLogger(__name__)

STEP_REQUESTS = {"step": pb.StepRequest, "allocate": pb.AllocateRequest, "free": pb.FreeRequest,
                 "fork": pb.ForkRequest}


def apply_entry(allocator: Allocator, entry: st.WalEntry, now: float) -> None:
    kind = entry.kind
    if kind in STEP_REQUESTS:
        request = STEP_REQUESTS[kind].FromString(entry.request)
        session = allocator.sessions.sessions[entry.session_id]
        pool = allocator.pool(request.pool_id)
        allocator.step(session, request.sequence, pool, ops_from_request(kind, request, pool.spec,
                                                                         allocator.hash_block_size))
    elif kind == "open_session":
        allocator.open_session(entry.session_id, entry.tenant, entry.client_name, now)
    elif kind == "register_pool":
        request = pb.RegisterPoolRequest.FromString(entry.request)
        session = allocator.sessions.sessions[entry.session_id]
        allocator.register_pool(session, request.sequence, decode_pool_spec(request, allocator.hash_block_size),
                                request.hash_fingerprint)
    elif kind == "commit_transfer":
        request = pb.CommitTransferRequest.FromString(entry.request)
        session = allocator.sessions.sessions[entry.session_id]
        allocator.commit_transfer(session, request.sequence, allocator.pool(request.pool_id), request.transfer_id,
                                  request.abort)
    elif kind == "expire":
        for session_id in entry.session_ids:
            if session_id in allocator.sessions.sessions:
                allocator.close_session(session_id)
    elif kind == "reset":
        allocator.reset_prefix_cache(list(entry.pool_ids))
    elif kind == "stale_resume":
        for pool_id in entry.pool_ids:
            if pool_id in allocator.pools:
                allocator.bump_epoch(pool_id)
    elif kind == "barrier":
        pass
    else:
        raise ValueError(f"unknown WAL entry kind {kind!r}")


def recover(allocator: Allocator, snapshot: bytes | None, entries: Iterable[tuple[bytes, bytes]]) -> dict:
    """Rebuilds `allocator` (fresh) from the snapshot and the WAL entries after it.

    A `resync` barrier the snapshot does not cover marks a gap (mutations acknowledged while Redis was
    down were never logged): replay stops there and what follows is treated as lost, so clients that
    saw those acknowledgements get a new pool epoch on reconnect instead of stale blocks.
    """
    start = time.perf_counter()
    now = time.monotonic()
    if snapshot is not None:
        load_snapshot(snapshot, allocator, now)
    replayed = skipped = 0
    gap = False
    for _, raw in entries:
        entry = st.WalEntry.FromString(raw)
        if entry.kind == "barrier" and "resync" in entry.pool_ids:
            gap = True
        if gap:
            skipped += 1
            continue
        apply_entry(allocator, entry, now)
        replayed += 1
    allocator.sessions.restart_leases(time.monotonic())
    info = {"snapshot_bytes": len(snapshot or b""), "replayed": replayed, "skipped_after_gap": skipped,
            "seconds": time.perf_counter() - start}
    if gap:
        logger.warning("WAL has a gap (acknowledged while Redis was down and never resynced): %d entries after it "
                       "were not replayed; clients that saw them will get new pool epochs", skipped)
    return info
