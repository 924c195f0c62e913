"""RemoteKVCacheManager: vLLM 0.33.0's KVCacheManager surface, allocating from a kvservice pool.

The pool is this scheduler's own (registered with vLLM's semantics and hash spec), and kvservice's core
follows vLLM 0.33.0's semantics exactly (parity-tested), so the manager keeps an exact replica of it:
vLLM's own KVCacheManager, which it subclasses. Every call the scheduler makes is answered by the replica
at once — hits, fits, block ids — and recorded as the op the pool takes for it: AddRequestOp with the
request's own block hashes, an admission's AllocateOp, FreeOp, ResetPrefixCacheOp, and every other
allocation (running requests, their `cache_blocks`) as a row of an AllocateBatchOp (one packed op for the
step's runs of them). With one full-attention group, a running request's call that left the replica's
blocks as they were — no block allocated or freed, none cached: in steady decode, all but about one in
`block_size` — is not sent at all; the tokens it covered travel with the request's next row (the pool's
token count for a request may lag by up to a block; its blocks, cached blocks and free blocks never do).

`flush()` sends the ops of one scheduler step as one Step RPC. Its reply is checked against what the
replica answered: the same outcome per op and row, the same block ids, the same free-block count. A
difference raises `PoolDiverged`, and so does every later step. Pipelined (the default), the Step is sent
and checked by a background thread while the scheduler goes on, and its outcome is raised by the next
flush (the next schedule()), before that step's output leaves: the step's own output came from the replica,
which is exact for this engine; the check guards the pool the fleet sees. Unpipelined, flush() waits and
checks before the step's output leaves. With `step_interval_s`, `end_step()` (what schedule() calls) sends
at most one Step per interval: the steps in between add their ops to the next one (sending.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
from vllm.v1.request import RequestStatus

from kvservice.integrations.vllm.deferred import DeferredFrees, RecordingBlockPool
from kvservice.integrations.vllm.expected import Expected, InFlight, PoolDiverged, Rows
from kvservice.integrations.vllm.sending import StepSender
from kvservice.ops import (
    ROW_WIDTH,
    WAITING,
    AddRequestOp,
    AllocateOp,
    EvictBlocksOp,
    FreeHeldBlocksOp,
    FreeOp,
    GetNewBlocksOp,
    NewStepOp,
    Op,
    OpStatus,
    RemoveSkippedBlocksOp,
    ResetPrefixCacheOp,
    StepResult,
    TakeBlockCopiesOp,
    TouchBlocksOp,
    row_flags,
)

__all__ = ["Expected", "InFlight", "PoolDiverged", "RemoteKVCacheManager", "Rows"]

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_NOTHING: tuple[list[bytes], int] = ([], 0)  # no new hashes, no new tokens (never appended to)


class RemoteKVCacheManager(StepSender, KVCacheManager):
    """Args: `client` (a kvservice client on the allocator), `pool_id` (the registered pool), `pipeline`
    (check each Step's reply in the background, raising at the next flush), `step_interval_s` (pipelined:
    the least time between two Steps sent by `end_step`), then vLLM's KVCacheManager's arguments, by
    keyword."""

    num_spec_tokens = 0  # speculative decoding's draft tokens per step (set by __init__)

    def __init__(self, client, pool_id: str, *, hash_block_size: int, pipeline: bool = True, num_spec_tokens: int = 0,
                 step_interval_s: float = 0.0, **kwargs) -> None:
        super().__init__(hash_block_size=hash_block_size, **kwargs)
        self.num_spec_tokens = num_spec_tokens  # speculative decoding's draft tokens per step
        self.hash_block_size = hash_block_size
        self.client = client
        self.pool_id = pool_id
        self.pipeline = pipeline
        self.step_interval_s = step_interval_s if pipeline else 0.0
        self._sent_at = float("-inf")  # when the last Step left (time.monotonic())
        self.num_rpcs = 0
        self.num_steps = 0  # scheduler steps ended (end_step): num_rpcs / num_steps is the Step rate
        self.num_idle_rpcs = 0  # of num_rpcs: sent when the engine went idle (the scheduler's update_from_output)
        self.num_block_copies = 0  # partial prefix hits' copies taken (take_kv_cache_block_copies)
        self.last_result: StepResult | None = None
        self._ops: list[Op] = []
        self._expected: list[Expected | Rows] = []
        self._rows: Rows | None = None  # the open AllocateBatchOp (the last of _ops), if any
        # request id -> how many of its tokens and block hashes the pool has, and the last hash (vLLM's lookahead
        # hasher hashes a block only once the tokens after it exist: the hashes may trail the tokens)
        self._known: dict[str, tuple[int, int, bytes | None]] = {}
        self._failed: str | None = None  # why a Step failed or diverged: nothing may follow
        self._in_flight: InFlight | None = None
        self._executor: ThreadPoolExecutor | None = None
        # Folding: a running request's cache row of this step (its Rows, row and position), and the position of
        # the last record that is not a bare cache row (an allocation may join a cache row only after it).
        self._cache_rows: dict[str, tuple[Rows, int, int]] = {}
        self._position = 0
        self._last_barrier = 0
        # Eliding: a running request's call that leaves the replica's blocks as they were (no block allocated
        # or freed, none cached) is not sent; its tokens travel with the request's next row. Only with one
        # full-attention group: what a call cached shows in its per-request count of cached blocks, and it
        # never drops blocks (a sliding window's skipped block may only lose a reference, which neither the
        # free count nor the new blocks show).
        managers = self.coordinator.single_type_managers
        first = managers[0]
        full = len(managers) == 1 and type(first) is FullAttentionManager
        self._num_cached: dict[str, int] | None = first.num_cached_block if full else None
        self._free_queue = self.block_pool.free_block_queue
        # And vLLM's cache_blocks does nothing unless the request has a full, hashed, uncached block below its
        # cacheable tokens: with caching on, that is checked here first (parity-tested).
        plain = (full and type(self.coordinator) is UnitaryKVCacheCoordinator and self.enable_caching
                 and first.enable_caching and first.kv_cache_spec.prefix_cacheable
                 and first.block_size == hash_block_size)
        self._plain_cache = ((first.block_size, hash_block_size, self.coordinator.num_reprefillable_tokens)
                             if plain else None)
        # The scheduler's deferred frees (defer_block_free) return blocks to the block pool directly.
        self._deferred = DeferredFrees()
        self._hit_caps: dict[str, int] = {}  # request id -> its last hit lookup's cap (0.33's max_cache_hit_length)
        self._connector_lookups: set[str] = set()  # requests whose last lookup was the connector's per-group one
        # request id -> the shared-prefix boundary the pool has for it (vLLM's lookup sets it on the request; an
        # admission that changes it goes as an AllocateOp of its own, which carries it)
        self._boundaries: dict[str, int] = {}
        # Mamba states cached in a step hit only from the next: the pool hears where each scheduler step starts.
        self._marks_steps = any(isinstance(m, MambaManager) for m in managers)
        self.block_pool = RecordingBlockPool(self.block_pool, self._returned, self._evicted, self._taken,
                                             self._touched)

    # ---- recording -----------------------------------------------------------------------------
    def _beyond(self, request) -> int:
        """The tokens past the request's own that an allocation may cover, sent as num_output_placeholders
        (the pool checks computed + new tokens against tokens + this): async scheduling's output placeholders
        and speculative decoding's draft tokens (vLLM pads a new decode to the configured count)."""
        drafts = len(getattr(request, "spec_token_ids", ()))
        return request.num_output_placeholders + (drafts if drafts > self.num_spec_tokens else self.num_spec_tokens)

    def _sync(self, request) -> tuple[list[bytes], int]:
        """The request's block hashes and token count since the pool last heard of it (adding it if new)."""
        request_id = request.request_id
        num_tokens = request.num_tokens
        sent = self._known.get(request_id)
        hashes = request.block_hashes if self.enable_caching else ()
        if sent is None:  # (a pool without prefix caching takes no hashes, even where the request has them)
            self._record(AddRequestOp(request_id, block_hashes=list(hashes), num_tokens=num_tokens,
                                      num_prompt_tokens=request.num_prompt_tokens))
            self._known[request_id] = (num_tokens, len(hashes), hashes[-1] if hashes else None)
            return _NOTHING
        known, num_hashes, last = sent
        if num_tokens == known:  # (new hashes without new tokens wait for the next append)
            return _NOTHING
        if num_tokens < known or len(hashes) < num_hashes or (num_hashes and hashes[num_hashes - 1] != last):
            self._failed = f"request {request_id!r} lost tokens or rewrote its block hashes"
            raise PoolDiverged(f"request {request_id!r} went from {known} tokens and {num_hashes} block hashes to "
                               f"{num_tokens} and {len(hashes)} (or rewrote them); the pool only appends")
        self._known[request_id] = (num_tokens, len(hashes), hashes[-1] if hashes else None)
        return list(hashes[num_hashes:]), num_tokens - known

    def _record(self, op: Op, expected: Expected | None = None) -> None:
        """An op other than a row: it ends the open AllocateBatchOp, and rows after it may not fold before it."""
        self._rows = None
        self._ops.append(op)
        self._expected.append(expected or Expected())
        self._position += 1
        self._last_barrier = self._position

    def _row(self, request, hashes: list[bytes], num_append: int, num_new_tokens: int, num_lookahead_tokens: int,
             reserved_blocks: int, flags: int, cache_tokens: int) -> tuple[Rows, int]:
        """Appends a row for `request` to the open AllocateBatchOp (opening one): its Rows and index."""
        rows = self._rows
        if rows is None:
            rows = self._rows = Rows()
            self._ops.append(rows.op)
            self._expected.append(rows)
        op = rows.op
        op.request_ids.append(request.request_id)
        op.rows.extend((request.num_computed_tokens, num_new_tokens, num_lookahead_tokens, num_append, len(hashes),
                        self._beyond(request), request.num_in_flight_tokens, cache_tokens, reserved_blocks,
                        flags))
        if hashes:
            op.append_block_hashes.extend(hashes)
        self._position += 1
        return rows, len(op.request_ids) - 1

    def _allocation_row(self, request, hashes: list[bytes], num_append: int, num_new_tokens: int,
                        num_lookahead_tokens: int, reserved_blocks: int, flags: int, new) -> None:
        """Records an allocate_slots call without a hit (and the replica's answer `new`) as a row.

        Folded into the request's cache row of this step (one row instead of two: cache_blocks, then
        allocate_slots) when only bare cache rows came after that one and the request is as it was then:
        every allocation and free keeps its order, and caching commutes with allocations (it touches no free
        block). Else a row of its own."""
        cached = self._cache_rows.pop(request.request_id, None)
        if cached is not None and not num_append and cached[2] > self._last_barrier:
            rows, i, position = cached
            r = rows.op.rows
            base = ROW_WIDTH * i
            if (r[base] == request.num_computed_tokens and r[base + 5] == self._beyond(request)
                    and r[base + 6] == request.num_in_flight_tokens and not (r[base + 9] ^ flags) & WAITING):
                r[base + 1], r[base + 2] = num_new_tokens, num_lookahead_tokens
                r[base + 8], r[base + 9] = reserved_blocks, flags
                if new is not self.empty_kv_cache_blocks:
                    rows.answer(i, new)
                self._last_barrier = position  # an allocation now: cache rows before it may no longer take theirs
                return
        rows, i = self._row(request, hashes, num_append, num_new_tokens, num_lookahead_tokens, reserved_blocks, flags,
                            0)
        if new is not self.empty_kv_cache_blocks:
            rows.answer(i, new)
        self._last_barrier = self._position

    def _cache_row(self, request, hashes: list[bytes], num_append: int, flags: int, cache_tokens: int) -> None:
        """Records a cache_blocks call as a row (no barrier: an allocation after it may still fold into it)."""
        rows, i = self._row(request, hashes, num_append, 0, 0, 0, flags, cache_tokens)
        self._cache_rows[request.request_id] = (rows, i, self._position)

    # ---- vLLM's KVCacheManager, answered by the replica, recorded for the pool ----------------------
    def get_computed_blocks(self, request, *cap):
        """(0.33: `max_cache_hit_length`, a hit's cap (an auxiliary-output connector): the pool hears it.)"""
        request_id = request.request_id
        self._connector_lookups.discard(request_id)
        if cap and cap[0] is not None:
            self._hit_caps[request_id] = cap[0]
        else:
            self._hit_caps.pop(request_id, None)
        return super().get_computed_blocks(request, *cap)

    def get_computed_blocks_for_connector(self, request, *cap):
        """A KV connector's lookup (one that supports divergent hybrid hits): in a hybrid Mamba pool the
        full-attention hit, which the pool looks up the same way (AllocateOp.connector_lookup). Where vLLM falls
        back to get_computed_blocks, that call (above) says so."""
        request_id = request.request_id
        self._connector_lookups.add(request_id)
        if cap and cap[0] is not None:
            self._hit_caps[request_id] = cap[0]
        else:
            self._hit_caps.pop(request_id, None)
        return super().get_computed_blocks_for_connector(request, *cap)

    def new_step_starts(self) -> None:
        super().new_step_starts()
        if self._marks_steps and not (self._ops and type(self._ops[-1]) is NewStepOp):  # (two in a row are one)
            self._record(NewStepOp())

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None, num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()):
        waiting = request.status in _WAITING
        counts = self._num_cached
        boundary = getattr(request, "shared_prefix_boundary", 0)  # (0.33; 0.32 has none)
        # An admission with a hit (the pool checks it), a KV connector's tokens, encoder tokens or a new
        # shared-prefix boundary: its own op.
        whole = (num_new_computed_tokens > 0 or num_external_computed_tokens > 0 or num_encoder_tokens > 0
                 or (waiting and boundary != self._boundaries.get(request.request_id, 0)))
        elidable = counts is not None and not waiting and not whole
        if whole:
            hashes, num_append = self._sync(request)
            hit = num_new_computed_tokens > 0
            op = AllocateOp(request.request_id, request.num_computed_tokens, num_new_tokens, None, hashes or None,
                            num_append, num_lookahead_tokens, delay_cache_blocks, False, None,
                            self._beyond(request), request.num_in_flight_tokens, waiting,
                            num_new_computed_tokens > 0, num_new_computed_tokens, full_sequence_must_fit,
                            reserved_blocks, has_scheduled_reqs, 0, num_external_computed_tokens, num_encoder_tokens,
                            self._hit_caps.pop(request.request_id, 0) if hit else 0,
                            connector_lookup=hit and request.request_id in self._connector_lookups,
                            shared_prefix_boundary=boundary if waiting else None)
            self._connector_lookups.discard(request.request_id)
            if waiting:
                self._boundaries[request.request_id] = boundary
        elif elidable:
            cached, free = counts.get(request.request_id, 0), self._free_queue.num_free_blocks
        try:
            new = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                         num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                                         num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
                                         has_scheduled_reqs, skip_zeroing_group_ids)
        except BaseException as exc:  # the replica may have changed, the pool hears nothing: it would fall behind
            self._failed = f"allocate_slots raised {exc!r}"
            raise
        if whole:  # an admission's reply is its whole table
            self._record(op, Expected(OpStatus.NO_SPACE) if new is None
                         else Expected(OpStatus.OK, self.get_block_ids(request.request_id)))
        else:
            if (elidable and new is self.empty_kv_cache_blocks and self._free_queue.num_free_blocks == free
                    and counts.get(request.request_id, 0) == cached):
                return new  # elided: nothing changed
            hashes, num_append = self._sync(request)
            self._allocation_row(request, hashes, num_append, num_new_tokens, num_lookahead_tokens, reserved_blocks,
                                 row_flags(waiting, delay_cache_blocks, full_sequence_must_fit, has_scheduled_reqs),
                                 new)
        return new

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        counts, plain = self._num_cached, self._plain_cache
        cached = counts.get(request.request_id, 0) if counts is not None else None
        if plain is not None:  # vLLM's own early return, without its calls down to the group's manager
            block_size, hash_block_size, reprefillable = plain
            if cached >= min(num_computed_tokens - reprefillable,
                             len(request.block_hashes) * hash_block_size) // block_size:
                return
        super().cache_blocks(request, num_computed_tokens)
        if counts is not None and counts.get(request.request_id, 0) == cached:
            return  # elided: nothing cached
        if self.enable_caching and num_computed_tokens > 0:
            hashes, num_append = self._sync(request)
            self._cache_row(request, hashes, num_append, WAITING if request.status in _WAITING else 0,
                            num_computed_tokens)

    def free(self, request) -> None:
        super().free(request)
        self._hit_caps.pop(request.request_id, None)
        self._boundaries.pop(request.request_id, None)
        self._connector_lookups.discard(request.request_id)
        if self._known.pop(request.request_id, None) is not None:
            self._record(FreeOp(request.request_id))

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Called outside allocate_slots (a KV connector's finished request): the pool frees the same blocks,
        in the same place among the step's ops."""
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        if request_id in self._known:
            self._record(RemoveSkippedBlocksOp(request_id, processed_computed_tokens))

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self._record(ResetPrefixCacheOp())
        return True

    def pop_blocks_for_free(self, request):
        """A deferred free's first move: the pool hears of it at the second (`_returned`)."""
        blocks = super().pop_blocks_for_free(request)
        self._boundaries.pop(request.request_id, None)
        if self._known.pop(request.request_id, None) is not None:
            if blocks:
                self._deferred.popped(request.request_id, blocks)
            else:  # nothing to return later: the pool drops the request now
                self._record(FreeOp(request.request_id, popped=True))
        return blocks

    def take_kv_cache_block_copies(self):
        """(vLLM 0.33) The step's partial-hit copies: the pool drains its own (TakeBlockCopiesOp, the same pairs)
        and holds both ends of each until the scheduler frees them through the block pool (`_returned`)."""
        copies, retained = super().take_kv_cache_block_copies()
        if copies:
            self.num_block_copies += len(copies)
            self._record(TakeBlockCopiesOp([i for c in copies for i in (c.src_block_id, c.dst_block_id)]))
        return copies, retained

    def _returned(self, blocks) -> None:
        """The scheduler returns blocks to the block pool itself: a deferred free's second move, or held blocks
        (copy retentions, direct takes)."""
        ids = [b.block_id for b in blocks]
        request_id = self._deferred.returned(ids)
        if request_id is not None:
            self._record(FreeOp(request_id, popped=True))
            return
        # Held blocks (the null block is never held: vLLM's free_blocks skips it). Blocks neither popped nor held
        # are refused by the pool: PoolDiverged, never a wrong schedule.
        ids = [b.block_id for b in blocks if not b.is_null]
        if ids:
            self._record(FreeHeldBlocksOp(ids))

    def _touched(self, blocks) -> None:
        """Blocks pinned through the block pool itself (`block_pool.touch`: a KV connector offloading them)."""
        ids = [b.block_id for b in blocks if not b.is_null]
        if ids:
            self._record(TouchBlocksOp(ids))

    def _taken(self, blocks) -> None:
        """Blocks taken straight from the block pool (`block_pool.get_new_blocks`), held outside requests."""
        ids = [b.block_id for b in blocks]
        if ids:
            self._record(GetNewBlocksOp(len(ids)), Expected(OpStatus.OK, (ids,)))

    def _evicted(self, block_ids: list[int]) -> None:
        """Blocks left the replica's prefix cache (evict_blocks, the manager's or the block pool's)."""
        if block_ids:
            self._record(EvictBlocksOp(block_ids))
