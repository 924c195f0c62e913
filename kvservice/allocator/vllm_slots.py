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
from kvservice.ops import (
    DELAY_CACHE_BLOCKS,
    FULL_SEQUENCE_MUST_FIT,
    HAS_SCHEDULED_REQS,
    ROW_WIDTH,
    WAITING,
    AllocateBatchOp,
    AllocateOp,
    FreeHeldBlocksOp,
    GetNewBlocksOp,
    OpResult,
    OpStatus,
    PackedResult,
    TouchBlocksOp,
)


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

    @staticmethod
    def held_blocks(pool: Pool, op) -> OpResult:
        """TakeBlockCopiesOp, GetNewBlocksOp, TouchBlocksOp, FreeHeldBlocksOp: the blocks a vLLM scheduler holds
        outside its requests (the core's `held`). A refusal changes nothing."""
        held = pool.manager.held
        kind = type(op)
        if kind is GetNewBlocksOp:
            free = pool.manager.block_pool.get_num_free_blocks()
            if op.num_blocks > free:
                return OpResult("", OpStatus.NO_SPACE, f"pool {pool.pool_id!r} has {free} free blocks, "
                                                       f"not {op.num_blocks}")
            return OpResult("", new_block_ids=(held.get_new_blocks(op.num_blocks),))
        ids = op.block_ids
        try:
            if kind is TouchBlocksOp:
                held.touch(ids)
            elif kind is FreeHeldBlocksOp:
                held.free(ids)
            else:
                pool.manager.take_held_block_copies(list(zip(ids[::2], ids[1::2])))
        except ValueError as exc:
            return OpResult("", OpStatus.FAILED_PRECONDITION, f"pool {pool.pool_id!r}: {exc}")
        return OpResult("")

    def allocate_batch(self, pool: Pool, tenant: str, op: AllocateBatchOp) -> OpResult:
        """Each row exactly as its AllocateOp (`allocate_op`), in order; the outcomes packed: a status, the new
        blocks per group, the computed and scheduled tokens per row, and the refusals' results.

        A running request's row that `plan` surely passes and whose slots its blocks already hold (the decode
        step) is applied here, from the columns; every other row goes through `allocate_op`."""
        manager = pool.manager
        num_groups = len(pool.spec.config.groups)
        statuses = bytearray(len(op.request_ids))
        out = PackedRows()
        counts, ids, computed, scheduled = out.num_new_blocks, out.new_block_ids, out.num_computed, out.num_scheduled
        failures: list[OpResult] = []
        replaced: list[tuple[int, int, int, int]] = []
        none = [0] * num_groups
        m = _decode_manager(manager)
        requests, max_len = pool.requests, pool.spec.max_model_len
        rows, hashes = op.rows, op.append_block_hashes
        h = 0
        ops = None
        for i, request_id in enumerate(op.request_ids):
            key = f"{tenant}{SEP}{request_id}" if tenant else request_id
            b = ROW_WIDTH * i
            num_computed, num_new, lookahead, num_append, num_hashes, placeholders, in_flight, cache, reserved, \
                flags = rows[b:b + ROW_WIDTH]
            appended = hashes[h:h + num_hashes] if num_hashes else None
            h += num_hashes
            req = requests.get(key) if m is not None else None
            if (req is not None and num_new and not reserved and not flags & (WAITING | FULL_SEQUENCE_MUST_FIT)
                    and not ((num_append or num_hashes) and hash_append_refusal(req, appended, num_append))):
                num_tokens = req.num_tokens + num_append
                if num_tokens <= max_len and num_computed + num_new <= num_tokens + placeholders \
                        and cache <= num_tokens:  # `plan` passes: apply's steps, as they are
                    if num_append:
                        req.append_block_hashes(appended or [], num_append)
                    req.num_computed_tokens, req.num_in_flight_tokens, req.waiting = num_computed, in_flight, False
                    if cache:
                        manager.cache_blocks(req, cache)
                    delay = bool(flags & DELAY_CACHE_BLOCKS)
                    if _takes_no_block(manager, m, key, req, num_computed, num_new, lookahead, delay):
                        counts.extend(none)
                        computed.append(num_computed)
                        scheduled.append(num_new)
                        continue
                    r = self._allocate(pool, key, req, request_id, num_computed, num_new, lookahead, delay, False, 0,
                                       bool(flags & HAS_SCHEDULED_REQS), None, shortcut=False)
                else:
                    r = None
            else:
                r = None
            if r is None:
                ops = ops or op.ops()
                r = self.allocate_op(pool, key, ops[i])
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
            if op.num_new_tokens == 0 and not op.num_append_tokens and not op.num_external_computed_tokens:
                return _refused(request_id, "num_new_tokens must be greater than 0 when there are no computed "
                                            "tokens to adopt")
            return None
        if manager.coordinator.is_running(key) or any(manager.coordinator.get_blocks(key)):
            return _refused(request_id, f"request {client_request_id(key)!r} holds blocks: an admission (lookup) "
                                        f"is for a waiting request")
        cap = op.max_cache_hit_length or None
        if op.connector_lookup:  # (a hybrid Mamba pool's divergent hit: the full-attention one)
            blocks, hit, _, _ = manager.get_computed_blocks_for_connector(req, cap)
        else:
            blocks, hit, _ = manager.find_computed_blocks(req, cap, record_stats=False)
        if hit != op.num_new_computed_tokens:
            return _refused(request_id, f"request {client_request_id(key)!r}: pool {pool.pool_id!r} has {hit} of its "
                                        f"tokens cached, the scheduler expected {op.num_new_computed_tokens} (its "
                                        f"view of the pool is stale); nothing was applied")
        if op.num_new_tokens == 0 and hit == 0 and not op.num_external_computed_tokens:
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
        if op.shared_prefix_boundary is not None:  # (vLLM's lookup set it; the request keeps it)
            req.shared_prefix_boundary = op.shared_prefix_boundary
        if op.cache_tokens:  # cache_blocks first, as the scheduler called it (a refusal below leaves it done)
            manager.cache_blocks(req, op.cache_tokens)
            if op.num_new_tokens == 0:
                return OpResult(request_id, num_computed_tokens=op.num_computed_tokens, num_tokens=req.num_tokens)
        if op.num_new_tokens == 0 and hit is None and not op.num_external_computed_tokens:  # new tokens only
            return OpResult(request_id, num_computed_tokens=op.num_computed_tokens, num_tokens=req.num_tokens)
        return self._allocate(pool, key, req, request_id, op.num_computed_tokens, op.num_new_tokens,
                              op.num_lookahead_tokens, op.delay_cache_blocks, op.full_sequence_must_fit,
                              op.reserved_blocks, op.has_scheduled_reqs, hit, op.waiting,
                              external=op.num_external_computed_tokens, encoder=op.num_encoder_tokens)

    def _allocate(self, pool: Pool, key: str, req: Request, request_id: str, num_computed: int, num_new: int,
                  lookahead: int, delay: bool, full_sequence_must_fit: bool, reserved_blocks: int,
                  has_scheduled_reqs: bool, hit: Hit | None, waiting: bool = False,
                  shortcut: bool = True, external: int = 0, encoder: int = 0) -> OpResult:
        """The core's allocate_slots for the op (its request's counters set), as an OpResult; `shortcut`: try
        `_takes_no_block` first (False: the caller did)."""
        manager = pool.manager
        if shortcut and hit is None and not (waiting or full_sequence_must_fit or reserved_blocks or external
                                             or encoder):
            m = _decode_manager(manager)
            if m is not None and _takes_no_block(manager, m, key, req, num_computed, num_new, lookahead, delay):
                return OpResult(request_id, OpStatus.OK, "", ([],), num_computed, num_new, req.num_tokens)
        num_hit = hit.num_tokens if hit is not None else 0
        new = manager.allocate_slots(req, num_new, num_hit, hit.blocks if hit is not None else None, lookahead, delay,
                                     num_external_computed_tokens=external, num_encoder_tokens=encoder,
                                     full_sequence_must_fit=full_sequence_must_fit, reserved_blocks=reserved_blocks,
                                     has_scheduled_reqs=has_scheduled_reqs)
        if new is None:
            free = manager.block_pool.get_num_free_blocks()
            return OpResult(request_id, OpStatus.NO_SPACE,
                            f"pool {pool.pool_id!r} has {free} free blocks, not enough for {num_new} more "
                            f"tokens of {client_request_id(key)!r}", (), num_computed + num_hit, 0, req.num_tokens)
        if hit is not None or external or encoder:
            if hit is not None:
                manager.record_prefix_cache_stats(req, num_hit)
            req.num_computed_tokens = num_hit + external
            # An admission: the engine has no row yet, so it gets the whole table (hits included).
            return OpResult(request_id, OpStatus.OK, "", manager.get_block_ids(key), num_hit + external, num_new,
                            req.num_tokens, replaced=new.replaced)
        return OpResult(request_id, OpStatus.OK, "", new.get_block_ids(), num_computed, num_new, req.num_tokens,
                        replaced=new.replaced)


def _decode_manager(manager):
    """The pool's one full-attention group's manager when `_takes_no_block` may decide its decode steps."""
    coordinator = manager.coordinator
    if type(coordinator) is not UnitaryKVCacheCoordinator or coordinator.retention_interval is not None \
            or coordinator.num_reprefillable_tokens:
        return None
    m = coordinator.single_type_managers[0]
    return m if type(m) is FullAttentionManager else None


def _takes_no_block(manager, m, key: str, req: Request, num_computed: int, num_new: int, lookahead: int,
                    delay: bool) -> bool:
    """The decode step of a running request (not waiting, no gate, no reserved blocks, no hit) whose slots its
    blocks already hold, on the single full-attention group `m` (`_decode_manager`), without the core's general
    path: what allocate_slots does then, it does — cache the blocks that are full — and True; False (nothing
    done) for anything else, which the core's allocate_slots decides.

    Exactly the core's outcome there: no watermark (not waiting), with the held blocks covering every slot no
    block is counted, skipped (full attention), copied (no fork or partial hit pending) or allocated, and the
    refusal `0 > free blocks` cannot happen."""
    if key not in m.num_cached_block or key in m._partial_hit_reqs:
        return False
    max_len = manager.max_model_len
    total = num_computed if num_computed < max_len else max_len
    num_main = total + num_new
    num_need = min(num_main + lookahead, max_len)
    if -(-num_need // m.block_size) > len(m.req_to_blocks.get(key, ())) or m.cow_indices(key, total, num_need, req):
        return False
    if manager.enable_caching and m.enable_caching and not delay:
        m.cache_blocks(req, num_main if num_main < req.num_tokens else req.num_tokens)
    return True


def _refused(request_id: str, why: str) -> OpResult:
    return OpResult(request_id, OpStatus.FAILED_PRECONDITION, why)
