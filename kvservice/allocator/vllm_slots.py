"""An AllocateOp on a pool with vLLM's semantics: exactly vLLM 0.33.0's `KVCacheManager.allocate_slots` (or
`cache_blocks`), as vLLM's own scheduler calls it — so a scheduler mirroring this pool gets the same blocks.

Check, then act: `plan` validates the op against the request (appends, counts, the admission's hit against
the one the scheduler computed) and changes nothing; `apply` appends the request's new hashes (they are its
tokens, whatever the allocation decides) and calls the core, whose `allocate_slots` decides the fit itself
— the full-sequence gate, the watermark, reserved blocks — and, refusing, changes nothing but what vLLM's
changes (blocks outside a sliding window freed).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvservice.allocator.keys import SEP, client_request_id
from kvservice.allocator.pools import Pool
from kvservice.allocator.requests import RequestBook
from kvservice.allocator.schedule import hash_append_refusal
from kvservice.core import KVCacheBlocks, PackedRows, Request
from kvservice.core.coordinator import UnitaryKVCacheCoordinator
from kvservice.core.managers.attention import FullAttentionManager
from kvservice.ops import AllocateBatchOp, AllocateOp, OpResult, OpStatus, PackedResult


@dataclass(slots=True)
class Hit:
    """An admission's prefix-cache hit, found by `plan`."""

    blocks: KVCacheBlocks
    num_tokens: int


class VllmSlots:
    def __init__(self, book: RequestBook) -> None:
        self.book = book

    def allocate_op(self, pool: Pool, key: str, op: AllocateOp) -> OpResult:
        req = pool.requests.get(key)
        if req is None:
            return self.book.missing(pool, key, op.request_id)
        planned = self.plan(pool, key, req, op)
        if isinstance(planned, OpResult):
            return planned
        return self.apply(pool, key, req, op, planned)

    def allocate_batch(self, pool: Pool, tenant: str, op: AllocateBatchOp) -> OpResult:
        """Each row exactly as its AllocateOp (`allocate_op`), in order; the outcomes packed: a status, the new
        blocks per group, the computed and scheduled tokens per row, and the refusals' results."""
        num_groups = len(pool.spec.config.groups)
        statuses = bytearray(len(op.request_ids))
        out = PackedRows()
        counts, ids, computed, scheduled = out.num_new_blocks, out.new_block_ids, out.num_computed, out.num_scheduled
        failures: list[OpResult] = []
        replaced: list[tuple[int, int, int, int]] = []
        none = [0] * num_groups
        for i, a in enumerate(op.ops()):
            r = self.allocate_op(pool, f"{tenant}{SEP}{a.request_id}" if tenant else a.request_id, a)
            if r.status:
                statuses[i] = r.status
                failures.append(r)
                counts.extend(none)
            elif r.new_block_ids:
                for g in range(num_groups):
                    table = r.new_block_ids[g] if g < len(r.new_block_ids) else ()
                    counts.append(len(table))
                    ids.extend(table)
            else:
                counts.extend(none)
            computed.append(r.num_computed_tokens)
            scheduled.append(r.num_scheduled_tokens)
            for g, index, block_id in r.replaced:
                replaced.append((i, g, index, block_id))
        packed = PackedResult(bytes(statuses), counts, ids, computed, scheduled, failures, num_groups, replaced)
        return OpResult("", OpStatus.OK, "", (), 0, 0, 0, None, packed)

    # ---- check ---------------------------------------------------------------------------------
    def plan(self, pool: Pool, key: str, req: Request, op: AllocateOp) -> Hit | None | OpResult:
        """The admission's hit (None for other ops), or the refusal; changes nothing."""
        request_id = op.request_id
        if op.num_append_tokens or op.append_block_hashes:
            why = hash_append_refusal(req, op.append_block_hashes, op.num_append_tokens)
            if why is not None:
                return OpResult(request_id, OpStatus.FAILED_PRECONDITION, why)
        num_tokens = req.num_tokens + op.num_append_tokens
        if num_tokens > pool.spec.max_model_len:
            return _refused(request_id, f"request {client_request_id(key)!r} would hold {num_tokens} tokens > "
                                        f"max_model_len {pool.spec.max_model_len}")
        end = op.num_computed_tokens + op.num_new_tokens
        if end > num_tokens + op.num_output_placeholders:
            return _refused(request_id, f"request {client_request_id(key)!r}: num_computed_tokens "
                                        f"{op.num_computed_tokens} + num_new_tokens {op.num_new_tokens} exceed its "
                                        f"{num_tokens} tokens + {op.num_output_placeholders} output placeholders")
        manager = pool.manager
        if op.cache_tokens:
            if op.cache_tokens > num_tokens:
                return _refused(request_id, f"cache_tokens {op.cache_tokens} > the request's {num_tokens} tokens")
            if op.num_new_tokens == 0:
                return None
        if not op.lookup:
            if op.num_new_tokens == 0 and not op.num_append_tokens:
                return _refused(request_id, "num_new_tokens must be greater than 0 when there are no computed "
                                            "tokens to adopt")
            return None
        if manager.coordinator.is_running(key) or any(manager.coordinator.get_blocks(key)):
            return _refused(request_id, f"request {client_request_id(key)!r} holds blocks: an admission (lookup) "
                                        f"is for a waiting request")
        blocks, hit, _ = manager.find_computed_blocks(req, record_stats=False)
        if hit != op.num_new_computed_tokens:
            return _refused(request_id, f"request {client_request_id(key)!r}: pool {pool.pool_id!r} has {hit} of its "
                                        f"tokens cached, the scheduler expected {op.num_new_computed_tokens} (its "
                                        f"view of the pool is stale); nothing was applied")
        if op.num_new_tokens == 0 and hit == 0:
            return _refused(request_id, "num_new_tokens must be greater than 0 when there are no computed tokens "
                                        "to adopt")
        return Hit(blocks, hit)

    # ---- act -----------------------------------------------------------------------------------
    def apply(self, pool: Pool, key: str, req: Request, op: AllocateOp, hit: Hit | None) -> OpResult:
        manager = pool.manager
        request_id = op.request_id
        if op.num_append_tokens:
            req.append_block_hashes(op.append_block_hashes or [], op.num_append_tokens)
        req.num_computed_tokens = op.num_computed_tokens
        req.num_in_flight_tokens = op.num_in_flight_tokens
        req.waiting = op.waiting
        if op.cache_tokens:  # cache_blocks first, as the scheduler called it (a refusal below leaves it done)
            manager.cache_blocks(req, op.cache_tokens)
            if op.num_new_tokens == 0:
                return OpResult(request_id, num_computed_tokens=op.num_computed_tokens, num_tokens=req.num_tokens)
        if op.num_new_tokens == 0 and hit is None:  # the request's new tokens only
            return OpResult(request_id, num_computed_tokens=op.num_computed_tokens, num_tokens=req.num_tokens)
        if hit is None and _takes_no_block(manager, key, req, op):
            return OpResult(request_id, OpStatus.OK, "", ([],), op.num_computed_tokens, op.num_new_tokens,
                            req.num_tokens)
        num_hit = hit.num_tokens if hit is not None else 0
        new = manager.allocate_slots(req, op.num_new_tokens, num_hit, hit.blocks if hit is not None else None,
                                     op.num_lookahead_tokens, op.delay_cache_blocks,
                                     full_sequence_must_fit=op.full_sequence_must_fit,
                                     reserved_blocks=op.reserved_blocks, has_scheduled_reqs=op.has_scheduled_reqs)
        if new is None:
            free = manager.block_pool.get_num_free_blocks()
            return OpResult(request_id, OpStatus.NO_SPACE,
                            f"pool {pool.pool_id!r} has {free} free blocks, not enough for {op.num_new_tokens} more "
                            f"tokens of {client_request_id(key)!r}", (), op.num_computed_tokens + num_hit, 0,
                            req.num_tokens)
        if hit is not None:
            manager.record_prefix_cache_stats(req, num_hit)
            req.num_computed_tokens = num_hit
            # An admission: the engine has no row yet, so it gets the whole table (hits included).
            return OpResult(request_id, OpStatus.OK, "", manager.get_block_ids(key), num_hit, op.num_new_tokens,
                            req.num_tokens, replaced=new.replaced)
        return OpResult(request_id, OpStatus.OK, "", new.get_block_ids(), op.num_computed_tokens, op.num_new_tokens,
                        req.num_tokens, replaced=new.replaced)


def _takes_no_block(manager, key: str, req: Request, op: AllocateOp) -> bool:
    """The decode step of a running request whose slots its blocks already hold, on a single full-attention
    group, without the core's general path: what allocate_slots does then, it does — cache the blocks that
    are full — and True; False (nothing done) for anything else, which the core's allocate_slots decides.

    Exactly the core's outcome there: no watermark (not waiting), no gate, no reserved blocks, no new hit, and
    with the held blocks covering every slot, no block is counted, skipped (full attention), copied (no fork
    or partial hit pending) or allocated; the refusal `0 > free blocks` cannot happen."""
    if op.waiting or op.full_sequence_must_fit or op.reserved_blocks:
        return False
    coordinator = manager.coordinator
    if type(coordinator) is not UnitaryKVCacheCoordinator or coordinator.retention_interval is not None \
            or coordinator.num_reprefillable_tokens:
        return False
    m = coordinator.single_type_managers[0]
    if type(m) is not FullAttentionManager or key not in m.num_cached_block or key in m._partial_hit_reqs:
        return False
    max_len = manager.max_model_len
    total = op.num_computed_tokens if op.num_computed_tokens < max_len else max_len
    num_main = total + op.num_new_tokens
    num_need = min(num_main + op.num_lookahead_tokens, max_len)
    if -(-num_need // m.block_size) > len(m.req_to_blocks[key]) or m.cow_indices(key, total, num_need):
        return False
    if manager.enable_caching and m.enable_caching and not op.delay_cache_blocks:
        m.cache_blocks(req, num_main if num_main < req.num_tokens else req.num_tokens)
    return True


def _refused(request_id: str, why: str) -> OpResult:
    return OpResult(request_id, OpStatus.FAILED_PRECONDITION, why)
