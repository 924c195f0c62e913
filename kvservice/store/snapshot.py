"""Full allocator state ⇄ bytes: pools (config, epoch, every block's state, requests, tombstones),
sessions (last replies for retries) and counters. Framed with a magic, the hash-spec fingerprint and a
checksum, so a corrupt or foreign snapshot is refused whole, never half-loaded."""

from __future__ import annotations

import time
from array import array

import xxhash

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import state_pb2 as st
from kvservice.allocator import Allocator, AllocatorState
from kvservice.allocator.keys import tenant_of
from kvservice.allocator.pins import Pin
from kvservice.allocator.pools import Pool
from kvservice.allocator.sessions import Session
from kvservice.allocator.transfers import Transfer
from kvservice.core import Request
from kvservice.core.block_pool import gc_paused
from kvservice.core.state import GroupTables, ManagerState, export_manager_state, import_manager_state
from kvservice.external.snapshot import decode_from as decode_external
from kvservice.external.snapshot import encode_into as encode_external
from kvservice.hashing import HashSpec, MultiModalItem
from kvservice.ops import StepResult
from kvservice.results import RegisterResult
from kvservice.wire.encode import encode_config, encode_hash_spec, encode_vllm_options
from kvservice.wire.fields import decode_u32
from kvservice.wire.pool_spec import decode_pool_spec
from kvservice.wire.replies import (
    decode_register_result,
    decode_step_result,
    encode_register_result,
    encode_step_result,
)

MAGIC = b"KVSNAP1\n"


class SnapshotError(ValueError):
    """The snapshot cannot be loaded (corrupt, foreign, or for another hash spec)."""


def _u32(values) -> bytes:
    return array("I", values).tobytes()


def _from_u32(data: bytes, what: str) -> array:
    return decode_u32(what, data)


def _pairs(rows: dict[str, tuple[int, int]]) -> bytes:
    return _u32(n for pair in rows.values() for n in pair)


def _unpairs(keys, data: bytes, what: str) -> dict[str, tuple[int, int]]:
    values = _from_u32(data, what)
    if len(values) != 2 * len(keys):
        raise SnapshotError(f"a group's {what}: {len(keys)} keys and {len(values)} values (want two per key)")
    return {key: (values[2 * i], values[2 * i + 1]) for i, key in enumerate(keys)}


def _copies(data: bytes) -> list[tuple[int, int]]:
    values = _from_u32(data, "pending_copies")
    if len(values) % 2:
        raise SnapshotError(f"a group's pending_copies: {len(values)} block ids (want (src, dst) pairs)")
    return list(zip(values[::2], values[1::2]))


# ---- encode --------------------------------------------------------------------------------------
def encode_state(allocator: Allocator) -> st.Snapshot:
    state = allocator.state
    settings = state.settings
    snap = st.Snapshot(hash_block_size=settings.hash_block_size, hash_seed=settings.hash_seed,
                       next_event_sequence=state.events.next_sequence, lease_expiries=state.lease_expiries)
    for pool_id in sorted(state.pools):
        snap.pools.append(_encode_pool(state.pools[pool_id]))
    for session_id in sorted(state.sessions.sessions):
        snap.sessions.append(_encode_session(state.sessions.sessions[session_id]))
    book = state.transfers
    snap.next_transfer = book.next_id
    for transfer_id in sorted(book.transfers):
        t = book.transfers[transfer_id]
        snap.transfers.add(transfer_id=t.transfer_id, session_id=t.session_id, src_pool=t.src_pool, holder=t.holder,
                           dst_pool=t.dst_pool, dst_key=t.dst_key, src_block_ids=_u32(t.src_block_ids),
                           dst_block_ids=_u32(t.dst_block_ids), num_tokens=t.num_tokens)
    encode_external(state.external, snap)
    return snap


def dump(allocator: Allocator) -> bytes:
    payload = encode_state(allocator).SerializeToString(deterministic=True)
    return MAGIC + allocator.fingerprint.encode() + xxhash.xxh3_128_digest(payload) + payload


def state_digest(allocator: Allocator) -> str:
    """A hash of the whole state: equal digests mean equal state, block for block."""
    return xxhash.xxh3_128_hexdigest(encode_state(allocator).SerializeToString(deterministic=True))


def _encode_pool(pool: Pool) -> st.PoolState:
    spec = pool.spec
    reg = pb.RegisterPoolRequest(pool_id=spec.pool_id, epoch=pool.epoch, bound_to_session=spec.bound_to_session,
                                 suspend_on_session_end=spec.suspend_on_session_end, session_id=pool.bound_session,
                                 endpoint=spec.endpoint,
                                 config=encode_config(spec.config, spec.max_model_len, spec.dcp_world_size,
                                                      spec.enable_caching, spec.vocab_size, spec.kv_layout))
    if spec.hash_spec is not None:
        reg.hash_spec.CopyFrom(encode_hash_spec(spec.hash_spec))
    if spec.vllm is not None:
        reg.vllm.CopyFrom(encode_vllm_options(spec.vllm))
    ms = export_manager_state(pool.manager)
    m = st.ManagerState(ref_cnts=ms.ref_cnts.tobytes(), free_order=ms.free_order.tobytes(),
                        index_keys=b"".join(ms.index_keys), index_key_lengths=_u32(len(k) for k in ms.index_keys),
                        index_block_ids=ms.index_block_ids.tobytes(),
                        copy_src=_u32(s for s, _ in ms.copies), copy_dst=_u32(d for _, d in ms.copies),
                        evictions=ms.evictions, total_queries=ms.totals[0], total_hits=ms.totals[1],
                        total_requests=ms.totals[2], interval_stats=list(ms.interval),
                        interval_reset=ms.interval_reset, held_blocks=ms.held.tobytes())
    for g in ms.groups:
        m.groups.add(request_keys=g.request_keys, num_blocks=g.num_blocks.tobytes(), block_ids=g.block_ids.tobytes(),
                     running_keys=g.running_keys, num_cached_block=g.num_cached_block.tobytes(),
                     cached_this_step=g.cached_this_step, last_state_block_idx=g.last_state_block_idx,
                     num_retired_blocks=g.num_retired_blocks, allocated_block_reqs=g.allocated_block_reqs,
                     checkpoint_keys=list(g.checkpoints), checkpoints=_pairs(g.checkpoints),
                     partial_hit_keys=list(g.partial_hits), partial_hits=_pairs(g.partial_hits),
                     partial_tail_keys=list(g.partial_tails), partial_tails=_pairs(g.partial_tails),
                     pending_copies=_u32(n for pair in g.pending_copies for n in pair))
    out = st.PoolState(register_request=reg.SerializeToString(deterministic=True), pool_id=pool.pool_id,
                       epoch=pool.epoch, manager=m, tombstone_keys=list(pool.tombstones),
                       tombstone_reasons=list(pool.tombstones.values()), owner_tenant=pool.owner_tenant,
                       moving_to=pool.moving_to, suspended=pool.suspended)
    for key in sorted(pool.requests):
        out.requests.append(_encode_request(pool.requests[key], pool.owner.get(key, "")))
    for key in sorted(pool.pins):
        pin = pool.pins[key]
        out.pins.add(key=key, session_id=pin.session_id, block_ids=_u32(pin.block_ids), num_tokens=pin.num_tokens)
    return out


def _encode_request(req: Request, owner: str) -> st.RequestState:
    ns_len = len(req.namespace)
    hashes = b"".join(h[:-ns_len] for h in req.block_hashes) if ns_len else b"".join(req.block_hashes)
    return st.RequestState(
        key=req.request_id, has_token_ids=req.has_token_ids,
        token_ids=req.all_token_ids.tobytes() if req.has_token_ids else b"", num_tokens=req.num_tokens,
        num_prompt_tokens=req.num_prompt_tokens, num_computed_tokens=req.num_computed_tokens,
        num_preemptions=req.num_preemptions, block_hashes=hashes, namespace=req.namespace,
        cache_salt=req.cache_salt or "", has_cache_salt=req.cache_salt is not None, lora_name=req.lora_name or "",
        has_lora_name=req.lora_name is not None, hash_seed=req.hash_seed,
        mm_identifiers=[i.identifier for i in req.mm_items], mm_offsets=_u32(i.offset for i in req.mm_items),
        mm_lengths=_u32(i.length for i in req.mm_items), chain_tip=req._chain_tip, owner=owner,
        block_size=req.block_size, shared_prefix_boundary=req.shared_prefix_boundary)


def _encode_session(s: Session) -> st.SessionState:
    out = st.SessionState(session_id=s.session_id, tenant=s.tenant, client_name=s.client_name,
                          last_sequence=s.last_sequence, last_digest=s.last_digest)
    if isinstance(s.last_reply, StepResult):
        out.reply_kind = "step"
        out.reply = encode_step_result(s.last_reply, pb.StepResponse()).SerializeToString(deterministic=True)
    elif isinstance(s.last_reply, RegisterResult):
        out.reply_kind = "register"
        out.reply = encode_register_result(s.last_reply).SerializeToString(deterministic=True)
    for pool_id in sorted(s.requests):
        for key in sorted(s.requests[pool_id]):
            out.request_pool_ids.append(pool_id)
            out.request_keys.append(key)
    return out


# ---- decode --------------------------------------------------------------------------------------
def load(data: bytes, allocator: Allocator, now: float) -> None:
    """Restores `data` into a fresh allocator (same hash spec). Raises SnapshotError, leaving the
    allocator untouched, when the snapshot is corrupt or foreign."""
    if not data.startswith(MAGIC):
        raise SnapshotError("not a kvservice snapshot (bad magic): refusing to start from it")
    fingerprint = data[len(MAGIC):len(MAGIC) + 16].decode(errors="replace")
    checksum = data[len(MAGIC) + 16:len(MAGIC) + 32]
    payload = data[len(MAGIC) + 32:]
    settings = allocator.settings
    if fingerprint != allocator.fingerprint:
        raise SnapshotError(f"snapshot was written for hash spec {fingerprint!r}, this allocator uses "
                            f"{allocator.fingerprint!r} (seed {settings.hash_seed!r}, block "
                            f"{settings.hash_block_size}): start with the same --hash-seed/--hash-block-size")
    if xxhash.xxh3_128_digest(payload) != checksum:
        raise SnapshotError("snapshot checksum mismatch: the snapshot is corrupt")
    try:
        snap = st.Snapshot.FromString(payload)
        staged = AllocatorState(settings)
        with gc_paused():
            _decode_into(snap, staged, now)
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotError(f"snapshot could not be decoded: {exc!r}") from exc
    # Only a fully decoded state replaces the allocator's (never a half-loaded one).
    allocator.state.replace(staged)


def _decode_into(snap: st.Snapshot, state: AllocatorState, now: float) -> None:
    settings = state.settings
    if snap.hash_block_size != settings.hash_block_size or snap.hash_seed != settings.hash_seed:
        raise SnapshotError("snapshot hash spec does not match its header")
    state.events.next_sequence = snap.next_event_sequence
    state.lease_expiries = snap.lease_expiries
    for ps in snap.pools:
        _decode_pool(ps, state)
    for ss in snap.sessions:
        session = state.sessions.open(ss.session_id, ss.tenant, ss.client_name, now)
        session.last_sequence = ss.last_sequence
        session.last_digest = ss.last_digest
        if ss.reply_kind == "step":
            session.last_reply = decode_step_result(pb.StepResponse.FromString(ss.reply))
        elif ss.reply_kind == "register":
            session.last_reply = decode_register_result(pb.RegisterPoolResponse.FromString(ss.reply))
        for pool_id, key in zip(ss.request_pool_ids, ss.request_keys):
            session.own(pool_id, key)
    book = state.transfers
    book.next_id = snap.next_transfer or 1
    for ts in snap.transfers:
        t = Transfer(ts.transfer_id, ts.session_id, ts.src_pool, ts.holder, ts.dst_pool, ts.dst_key,
                     list(_from_u32(ts.src_block_ids, "src_block_ids")),
                     list(_from_u32(ts.dst_block_ids, "dst_block_ids")), ts.num_tokens)
        book.transfers[t.transfer_id] = t
        book.by_dst[(t.dst_pool, t.dst_key)] = t.transfer_id
    decode_external(snap, state.external, settings.hash_block_size, settings.hash_seed)


def _decode_pool(ps: st.PoolState, state: AllocatorState) -> Pool:
    """One pool into `state` (its requests' quota usage too; the sessions owning them are the caller's)."""
    settings = state.settings
    reg = pb.RegisterPoolRequest.FromString(ps.register_request)
    spec = decode_pool_spec(reg, settings.hash_block_size)  # its endpoint too (older snapshots: none, empty)
    pool = state.new_pool(spec)
    pool.bound_session = reg.session_id if spec.bound_to_session else ""
    pool.owner_tenant = ps.owner_tenant
    pool.moving_to = ps.moving_to
    pool.suspended = ps.suspended  # (absent in older snapshots: False, as no pool was suspended then)
    m = ps.manager
    lengths = _from_u32(m.index_key_lengths, "index_key_lengths")
    raw_keys = m.index_keys  # bind once: each protobuf field access copies the bytes
    keys, pos = [], 0
    for n in lengths:
        keys.append(raw_keys[pos:pos + n])
        pos += n
    ref_cnts = array("i")
    ref_cnts.frombytes(m.ref_cnts)
    groups = [GroupTables(list(g.request_keys), _from_u32(g.num_blocks, "num_blocks"),
                          _from_u32(g.block_ids, "block_ids"), list(g.running_keys),
                          _from_u32(g.num_cached_block, "num_cached_block"), list(g.cached_this_step),
                          dict(g.last_state_block_idx), dict(g.num_retired_blocks), list(g.allocated_block_reqs),
                          _unpairs(g.checkpoint_keys, g.checkpoints, "checkpoints"),
                          _unpairs(g.partial_hit_keys, g.partial_hits, "partial_hits"),
                          _unpairs(g.partial_tail_keys, g.partial_tails, "partial_tails"),
                          _copies(g.pending_copies))
              for g in m.groups]
    manager_state = ManagerState(ref_cnts, _from_u32(m.free_order, "free_order"), keys,
                                 _from_u32(m.index_block_ids, "index_block_ids"), groups,
                                 list(zip(_from_u32(m.copy_src, "copy_src"), _from_u32(m.copy_dst, "copy_dst"))),
                                 m.evictions, (m.total_queries, m.total_hits, m.total_requests),
                                 tuple(m.interval_stats), m.interval_reset,
                                 held=_from_u32(m.held_blocks, "held_blocks"))
    import_manager_state(pool.manager, manager_state)
    for rs in ps.requests:
        pool.requests[rs.key] = _decode_request(rs, pool.hash_spec, pool.hashes_may_lag)
        if rs.owner:
            pool.owner[rs.key] = rs.owner
    for key, reason in zip(ps.tombstone_keys, ps.tombstone_reasons):
        pool.tombstones[key] = reason
    for p in ps.pins:
        pool.pins[p.key] = Pin(p.key, p.session_id, list(_from_u32(p.block_ids, "pin block_ids")), p.num_tokens)
    state.pools[pool.pool_id] = pool
    for key in pool.requests:
        state.usage.update(tenant_of(key), pool, key)
    return pool


# ---- moving one pool between shards (rebalance) --------------------------------------------------
def export_pool(allocator: Allocator, pool_id: str) -> bytes:
    """The pool's whole state and the sessions owning its requests (it should be frozen: nothing moves)."""
    state = allocator.state
    pool = state.pools[pool_id]
    out = st.PoolExport(pool=_encode_pool(pool))
    out.pool.moving_to = ""  # it serves where it arrives
    for session_id in sorted(set(pool.owner.values()) | {pin.session_id for pin in pool.pins.values()}):
        session = state.sessions.sessions.get(session_id)
        if session is not None:
            out.session_ids.append(session_id)
            out.session_tenants.append(session.tenant)
            out.session_names.append(session.client_name)
    return out.SerializeToString(deterministic=True)


def import_pool(state: AllocatorState, data: bytes) -> str:
    """Installs an exported pool; its owners' sessions are opened here when this shard did not know them."""
    export = st.PoolExport.FromString(data)
    pool = _decode_pool(export.pool, state)
    now = time.monotonic()
    for session_id, tenant, name in zip(export.session_ids, export.session_tenants, export.session_names):
        if session_id not in state.sessions.sessions:
            state.sessions.open(session_id, tenant, name, now)
    for key, session_id in pool.owner.items():
        session = state.sessions.sessions.get(session_id)
        if session is not None:
            session.own(pool.pool_id, key)
    return pool.pool_id


def _decode_request(rs: st.RequestState, hash_spec: HashSpec, hashes_may_lag: bool = False) -> Request:
    req = Request.__new__(Request)
    if not hash_spec.is_kvservice:
        req.hash_spec = hash_spec
    req.request_id = rs.key
    req.block_size = rs.block_size
    req.cache_salt = rs.cache_salt if rs.has_cache_salt else None
    req.lora_name = rs.lora_name if rs.has_lora_name else None
    req.hash_seed = rs.hash_seed
    offsets, lengths = _from_u32(rs.mm_offsets, "mm_offsets"), _from_u32(rs.mm_lengths, "mm_lengths")
    req.mm_items = tuple(MultiModalItem(i, o, n) for i, o, n in zip(rs.mm_identifiers, offsets, lengths))
    req.namespace = rs.namespace
    req.num_prompt_tokens = rs.num_prompt_tokens
    if rs.has_token_ids:
        tokens = array("I")
        tokens.frombytes(rs.token_ids)
        req._token_ids = tokens
    else:
        req._token_ids = None
    req.num_tokens = rs.num_tokens
    req.num_computed_tokens = rs.num_computed_tokens
    req.num_preemptions = rs.num_preemptions
    if rs.shared_prefix_boundary:
        req.shared_prefix_boundary = rs.shared_prefix_boundary
    req._chain_tip = rs.chain_tip
    ns = rs.namespace
    raw = rs.block_hashes
    n = hash_spec.hash_bytes
    req.block_hashes = [raw[i:i + n] + ns for i in range(0, len(raw), n)]
    if hashes_may_lag and not rs.has_token_ids:
        req.hashes_may_lag = True  # (a pool whose requests' hashes may trail their blocks, with prefix caching)
    elif not rs.has_token_ids and len(req.block_hashes) < rs.num_tokens // rs.block_size:
        req.unhashed = True  # only an unhashed request (a pool without prefix caching) holds fewer hashes
    return req
