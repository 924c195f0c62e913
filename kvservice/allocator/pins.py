"""Pins: a prompt's cached prefix held in a pool for a cross-shard transfer (its source side). The pool and
the destination are on different shards, so the two-phase protocol runs through the client: PinOp here
(the blocks can be neither evicted nor reallocated), an admission with that external source on the
destination's shard (a transfer order), the copy, CommitTransfer there, UnpinOp here. A pin belongs to its
session: when the session's lease lapses it is released, so a client that dies mid-way frees everything.

An admission names its source by the pin (ExternalSource): only a live pin of the caller's tenant (an admin:
any tenant's), naming exactly its blocks and tokens, is a source; anything else is NOT_FOUND with the one
message `no_such_pin`, whatever was wrong (it tells a tenant nothing about another tenant's pins)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvservice.allocator.keys import SEP, client_request_id, namespace, request_key
from kvservice.allocator.pools import Pool
from kvservice.allocator.sessions import Session
from kvservice.allocator.state import AllocatorState
from kvservice.allocator.transfers import transferable
from kvservice.core import KVCacheBlocks
from kvservice.errors import NotFound
from kvservice.ops import AllocateOp, ExternalSource, OpResult, OpStatus, PinOp, UnpinOp


@dataclass(slots=True)
class Pin:
    key: str  # the tenant-namespaced pin id
    session_id: str
    block_ids: list[int]
    num_tokens: int

    @property
    def holder(self) -> str:
        """The manager's holder table for the pinned blocks."""
        return f"{SEP}pin{SEP}{self.key}"


def pin_matches(key: str, block_ids: Sequence[int], num_tokens: int, source: ExternalSource, tenant: str,
                admin: bool) -> bool:
    """Whether the pin `key` (holding `block_ids`, `num_tokens`) is what `source` names, for this caller."""
    named = key == request_key(tenant, source.pin_id) or (admin and client_request_id(key) == source.pin_id)
    return named and num_tokens == source.num_tokens and list(block_ids) == list(source.src_block_ids)


def live_pin(pool: Pool, source: ExternalSource, tenant: str, admin: bool) -> Pin | None:
    """The pin of `pool` that `source` names for this caller, if it is live."""
    if admin:
        candidates = list(pool.pins.values())
    else:
        own = pool.pins.get(request_key(tenant, source.pin_id))
        candidates = [own] if own is not None else []
    return next((p for p in candidates if pin_matches(p.key, p.block_ids, p.num_tokens, source, tenant, admin)),
                None)


class RemoteSources(Exception):
    """A Step names transfer sources on pools this allocator does not hold (another shard's): the server
    checks them there, then applies the Step as checked. Raised before anything changed."""

    def __init__(self, sources: list[ExternalSource]) -> None:
        super().__init__(f"{len(sources)} transfer sources on other shards' pools to check")
        self.sources = sources


def check_sources(pools: dict[str, Pool], ops: Sequence, tenant: str, admin: bool, remote_checked: bool) -> None:
    """Before a Step changes anything: NOT_FOUND for a source that is no live pin of a pool held here (the
    whole call: as for another shard's, so the answer never tells which pools are here), RemoteSources
    for sources on other pools unless the server checked them already."""
    remote = []
    for op in ops:
        if type(op) is AllocateOp and op.external_source is not None:
            source = op.external_source
            pool = pools.get(source.src_pool_id)
            if pool is None:
                remote.append(source)
            elif live_pin(pool, source, tenant, admin) is None:
                raise NotFound(no_such_pin(source))
    if remote and not remote_checked:
        raise RemoteSources(remote)


def no_such_pin(source: ExternalSource) -> str:
    return (f"external_source: pool {source.src_pool_id!r} holds no live pin {source.pin_id!r} of this tenant with "
            f"exactly the {len(source.src_block_ids)} blocks and {source.num_tokens} tokens named; pin the prefix "
            f"there (PinOp) and name what its result names")


class PinBook:
    def __init__(self, state: AllocatorState) -> None:
        self.state = state

    def pin(self, pool: Pool, session: Session, op: PinOp) -> OpResult:
        key = request_key(session.tenant, op.pin_id)
        if key in pool.pins:
            return OpResult(op.pin_id, OpStatus.ALREADY_EXISTS, f"pin {op.pin_id!r} already exists in pool "
                                                                f"{pool.pool_id!r}")
        if not transferable(pool):
            return OpResult(op.pin_id, OpStatus.FAILED_PRECONDITION,
                            f"pool {pool.pool_id!r} exchanges no blocks (one full-attention group, prefix "
                            f"caching on and a kv_layout declared are needed)")
        ns = namespace(session.tenant)
        if op.block_hashes is not None:
            req = pool.request_from_hashes(key, op.block_hashes, op.num_tokens, op.lora_name, ns)
        else:
            req = pool.request_from_tokens(key, op.token_ids, op.cache_salt, op.lora_name, namespace=ns)
        found, hit = pool.manager.coordinator.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)
        if not hit:
            return OpResult(op.pin_id, num_computed_tokens=0)  # nothing cached: nothing to pin
        pin = Pin(key, session.session_id, [b.block_id for b in found[0]], hit)
        pool.manager.hold(pin.holder, KVCacheBlocks(found))
        pool.pins[key] = pin
        return OpResult(op.pin_id, new_block_ids=(list(pin.block_ids),), num_computed_tokens=hit)

    def unpin(self, pool: Pool, session: Session, op: UnpinOp) -> OpResult:
        key = request_key(session.tenant, op.pin_id)
        pin = pool.pins.get(key)
        if pin is None:
            return OpResult(op.pin_id, OpStatus.NOT_FOUND, f"no pin {op.pin_id!r} in pool {pool.pool_id!r}")
        self.release(pool, pin)
        return OpResult(op.pin_id)

    @staticmethod
    def release(pool: Pool, pin: Pin) -> None:
        del pool.pins[pin.key]
        pool.manager.release(pin.holder)



def release_session_pins(state: AllocatorState, session_id: str) -> None:
    """The session's lease lapsed: every pin it holds goes."""
    for pool in state.pools.values():
        pins = [p for p in pool.pins.values() if p.session_id == session_id]
        for pin in pins:
            PinBook.release(pool, pin)
        if pins:
            state.drain(pool)
