"""Replies both ways, each translation written once: the server encodes result records, the client decodes
them back into the same records, and snapshots store a session's last reply with the same encoders."""

from __future__ import annotations

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator.events import LoggedEvent
from kvservice.allocator.keys import raw_hash
from kvservice.core import AllBlocksCleared, BlockRemoved, BlockStored
from kvservice.external.wire import decode_stats as decode_external_stats
from kvservice.ops import OpResult, OpStatus, PackedResult, StepResult, TransferOrder
from kvservice.results import (
    Event,
    LookupResult,
    PoolHit,
    PoolStats,
    RegisterResult,
    RequestInfo,
    SessionOpened,
    Stats,
)
from kvservice.wire.fields import decode_u32, encode_u32


# ---- Step ----------------------------------------------------------------------------------------
def encode_step_result(result: StepResult, msg: pb.StepResponse) -> pb.StepResponse:
    """Groups' new block ids are sent only when some group got a block (decode steps mostly don't)."""
    msg.sequence = result.sequence
    add = msg.results.add
    for r in result.results:
        # Fields one by one, zeros left unset (proto3: the same bytes): cheaper than keyword construction.
        m = add()
        m.request_id = r.request_id
        if r.status:
            m.status = r.status
        if r.message:
            m.message = r.message
        if r.num_computed_tokens:
            m.num_computed_tokens = r.num_computed_tokens
        if r.num_scheduled_tokens:
            m.num_scheduled_tokens = r.num_scheduled_tokens
        if r.num_tokens:
            m.num_tokens = r.num_tokens
        groups = r.new_block_ids
        if groups and (len(groups) > 1 or groups[0]):
            group_add = m.new_blocks.add
            for ids in groups:
                group_add().block_ids.extend(ids)
        for g, index, block_id in r.replaced:
            m.replaced.add(group=g, index=index, block_id=block_id)
        if r.transfer is not None:
            t = r.transfer
            m.transfer.CopyFrom(pb.TransferOrder(transfer_id=t.transfer_id, src_pool_id=t.src_pool_id,
                                                 src_block_ids=t.src_block_ids, dst_block_ids=t.dst_block_ids,
                                                 num_tokens=t.num_tokens))
        if r.batch is not None:
            _encode_packed(r.batch, m.batch)
    for src, dst in result.copies:
        msg.copies.add(src=src, dst=dst)
    if result.num_free_blocks:
        msg.num_free_blocks = result.num_free_blocks
    return msg


def _encode_packed(b: PackedResult, mb: pb.DecodeBatchResult) -> None:
    mb.statuses = b.statuses
    mb.num_new_blocks = encode_u32(b.num_new_blocks)
    mb.new_block_ids = encode_u32(b.new_block_ids)
    mb.num_computed_tokens = encode_u32(b.num_computed_tokens)
    mb.num_scheduled_tokens = encode_u32(b.num_scheduled_tokens)
    mb.num_groups = b.num_groups
    if b.replaced:
        mb.replaced = encode_u32([v for quad in b.replaced for v in quad])
    if b.failures:
        mb.failures.extend(encode_step_result(StepResult(0, b.failures), pb.StepResponse()).results)


def decode_step_result(msg: pb.StepResponse) -> StepResult:
    results = []
    for m in msg.results:
        transfer = None
        if m.HasField("transfer"):
            t = m.transfer
            transfer = TransferOrder(t.transfer_id, t.src_pool_id, list(t.src_block_ids), list(t.dst_block_ids),
                                     t.num_tokens)
        batch = _decode_packed(m.batch) if m.HasField("batch") else None
        results.append(OpResult(m.request_id, OpStatus(m.status), m.message,
                                tuple(list(g.block_ids) for g in m.new_blocks), m.num_computed_tokens,
                                m.num_scheduled_tokens, m.num_tokens, transfer, batch,
                                [(x.group, x.index, x.block_id) for x in m.replaced]))
    return StepResult(msg.sequence, results, [(c.src, c.dst) for c in msg.copies], msg.num_free_blocks)


def _decode_packed(b: pb.DecodeBatchResult) -> PackedResult:
    flat = decode_u32("replaced", b.replaced)
    return PackedResult(b.statuses, decode_u32("num_new_blocks", b.num_new_blocks),
                        decode_u32("new_block_ids", b.new_block_ids),
                        decode_u32("num_computed_tokens", b.num_computed_tokens),
                        decode_u32("num_scheduled_tokens", b.num_scheduled_tokens),
                        decode_step_result(pb.StepResponse(results=b.failures)).results, b.num_groups,
                        [tuple(flat[j:j + 4]) for j in range(0, len(flat), 4)])


# ---- sessions and pools --------------------------------------------------------------------------
def encode_register_result(r: RegisterResult) -> pb.RegisterPoolResponse:
    return pb.RegisterPoolResponse(pool_id=r.pool_id, epoch=r.epoch, new_epoch=r.new_epoch,
                                   hash_block_size=r.hash_block_size, hash_seed=r.hash_seed,
                                   num_requests_failed=r.num_requests_failed,
                                   scheduler_block_size=r.scheduler_block_size, hash_algorithm=r.hash_algorithm,
                                   hash_fingerprint=r.hash_fingerprint)


def decode_register_result(r: pb.RegisterPoolResponse) -> RegisterResult:
    return RegisterResult(r.pool_id, r.epoch, r.new_epoch, r.hash_block_size, r.hash_seed, r.num_requests_failed,
                          r.scheduler_block_size, r.hash_algorithm or "kvservice", r.hash_fingerprint)


def encode_session_opened(s: SessionOpened) -> pb.OpenSessionResponse:
    return pb.OpenSessionResponse(session_id=s.session_id, ttl_ms=s.ttl_ms, next_sequence=s.next_sequence,
                                  tenant=s.tenant, pools_failed=s.pools_failed)


def decode_session_opened(r: pb.OpenSessionResponse) -> SessionOpened:
    return SessionOpened(r.session_id, r.tenant, r.next_sequence, r.ttl_ms, list(r.pools_failed))


# ---- reads ---------------------------------------------------------------------------------------
def encode_request_info(r: RequestInfo) -> pb.RequestInfo:
    info = pb.RequestInfo(request_id=r.request_id, pool_id=r.pool_id, num_tokens=r.num_tokens,
                          num_computed_tokens=r.num_computed_tokens, num_block_hashes=r.num_block_hashes,
                          running=r.running, session_id=r.session_id)
    for ids in r.block_ids:
        info.blocks.add(block_ids=ids)
    return info


def decode_request_info(r: pb.RequestInfo) -> RequestInfo:
    return RequestInfo(r.request_id, r.pool_id, r.num_tokens, r.num_computed_tokens,
                       tuple(list(g.block_ids) for g in r.blocks), r.num_block_hashes, r.running, r.session_id)


def encode_lookup(r: LookupResult) -> pb.LookupResponse:
    out = pb.LookupResponse(best_pool_id=r.best_pool_id)
    for h in r.hits:
        hit = out.hits.add(pool_id=h.pool_id, num_cached_tokens=h.num_cached_tokens, num_free_blocks=h.num_free_blocks,
                           num_cached_blocks=h.num_cached_blocks, suspended=h.suspended)
        if h.external:
            hit.external = True
            for medium, n in h.tiers.items():
                hit.tiers.add(medium=medium, num_cached_tokens=n)
    return out


def decode_lookup(r: pb.LookupResponse) -> LookupResult:
    return LookupResult([PoolHit(h.pool_id, h.num_cached_tokens, h.num_free_blocks, h.num_cached_blocks, h.external,
                                 {t.medium: t.num_cached_tokens for t in h.tiers}, h.suspended) for h in r.hits],
                         r.best_pool_id)


def encode_pool_stats(p: PoolStats, out: pb.PoolStats) -> None:
    out.pool_id, out.epoch, out.num_blocks, out.num_free_blocks = p.pool_id, p.epoch, p.num_blocks, p.num_free_blocks
    out.usage, out.num_requests, out.prefix_hit_rate = p.usage, p.num_requests, p.prefix_hit_rate
    out.prefix_queries, out.prefix_hits, out.evictions = p.prefix_queries, p.prefix_hits, p.evictions
    out.num_cached_blocks, out.num_pending_transfers = p.num_cached_blocks, p.num_pending_transfers
    out.invariant_violation, out.plain_prefix, out.moving_to = p.invariant_violation, p.plain_prefix, p.moving_to
    out.suspended, out.endpoint, out.endpoint_size = p.suspended, p.endpoint, p.endpoint_size


def decode_stats(r: pb.GetStatsResponse) -> Stats:
    pools = {p.pool_id: PoolStats(p.pool_id, p.epoch, p.num_blocks, p.num_free_blocks, p.usage, p.num_requests,
                                  p.prefix_hit_rate, p.prefix_queries, p.prefix_hits, p.evictions,
                                  p.num_cached_blocks, p.invariant_violation, p.num_pending_transfers,
                                  p.plain_prefix, p.moving_to, p.suspended, p.endpoint, p.endpoint_size)
             for p in r.pools}
    external = {p.pool_id: decode_external_stats(p) for p in r.external_pools}
    return Stats(pools, r.num_sessions, r.persistence, r.event_sequence, r.lease_expiries, r.hash_fingerprint,
                 r.hash_block_size, r.state_digest, r.leader_epoch, external)


# ---- events --------------------------------------------------------------------------------------
def encode_event(item: LoggedEvent) -> pb.KVEvent:
    """A logged core event in the caller's own (tenant-free) hashes."""
    msg = pb.KVEvent(sequence=item.sequence, pool_id=item.pool_id)
    ev = item.event
    if isinstance(ev, BlockStored):
        n = item.hash_bytes
        msg.stored.block_hashes.extend(raw_hash(h, n) for h in ev.block_hashes)
        if ev.parent_block_hash is not None:
            msg.stored.parent_block_hash = raw_hash(ev.parent_block_hash, n)
        if ev.token_ids:
            msg.stored.token_ids = encode_u32(ev.token_ids)
        msg.stored.block_size = ev.block_size
        msg.stored.group_idx = ev.group_idx
        msg.stored.lora_name = ev.lora_name or ""
        msg.stored.block_ids.extend(ev.block_ids)
    elif isinstance(ev, BlockRemoved):
        msg.removed.block_hashes.extend(raw_hash(h, item.hash_bytes) for h in ev.block_hashes)
        msg.removed.group_idx = ev.group_idx
    elif isinstance(ev, AllBlocksCleared):
        msg.cleared.SetInParent()
    return msg


def decode_event(e: pb.KVEvent) -> Event:
    kind = e.WhichOneof("event")
    if kind == "stored":
        s = e.stored
        return Event(e.sequence, e.pool_id, kind, list(s.block_hashes), s.parent_block_hash or None,
                     list(decode_u32("token_ids", s.token_ids)), list(s.block_ids), s.group_idx)
    if kind == "removed":
        return Event(e.sequence, e.pool_id, kind, list(e.removed.block_hashes), group_idx=e.removed.group_idx)
    return Event(e.sequence, e.pool_id, kind or "cleared", [])  # "cleared", or "synced" (an include_state dump's end)


def encode_state(pool_id: str, sequence: int, cached: dict[int, list[bytes]], hash_bytes: int,
                 chunk: int = 4096) -> list[pb.KVEvent]:
    """A pool's state as events (WatchEvents include_state): `cleared`, then its cached (tenant-free) hashes
    as `stored` events of at most `chunk` each, per group."""
    out = [pb.KVEvent(sequence=sequence, pool_id=pool_id, cleared=pb.AllBlocksClearedEvent())]
    for group, hashes in sorted(cached.items()):
        for i in range(0, len(hashes), chunk):
            msg = pb.KVEvent(sequence=sequence, pool_id=pool_id)
            msg.stored.block_hashes.extend(raw_hash(h, hash_bytes) for h in hashes[i:i + chunk])
            msg.stored.group_idx = group
            out.append(msg)
    return out
