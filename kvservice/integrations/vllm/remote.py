"""RemoteKVCacheManager: vLLM 0.33.0's KVCacheManager surface, allocating from a kvservice pool.

The pool is this scheduler's own (registered with vLLM's semantics and hash spec), and the core is
deterministic, so the manager keeps an exact replica of it: the drop-in KVCacheManager (kvservice.core
with vLLM's names). Every call the scheduler makes is answered by the replica at once — hits, fits, block
ids — and recorded as the op the pool takes for it (AddRequestOp with the request's own block hashes,
AllocateOp with all of allocate_slots' arguments, FreeOp, ResetPrefixCacheOp). `flush()` sends the ops of
one scheduler step as one Step RPC and checks every reply against the replica: the same outcome, the same
block ids, the same free-block count. A difference raises `PoolDiverged` before the step's SchedulerOutput
leaves the scheduler, so a wrong schedule never reaches the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm.v1.request import RequestStatus

from kvservice.integrations.vllm.manager import KVCacheManager
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, Op, OpStatus, ResetPrefixCacheOp, StepResult

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class PoolDiverged(RuntimeError):
    """The allocator's pool answered differently from the scheduler's replica of it."""


@dataclass(slots=True)
class Expected:
    """What the replica answered for one op: OK with these block ids (None: unchecked), or NO_SPACE."""

    status: OpStatus = OpStatus.OK
    block_ids: tuple[list[int], ...] | None = None


class RemoteKVCacheManager(KVCacheManager):
    """Args: `client` (a kvservice client on the allocator), `pool_id` (the registered pool), then the
    drop-in KVCacheManager's (vLLM's) arguments."""

    def __init__(self, client, pool_id: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.client = client
        self.pool_id = pool_id
        self.num_rpcs = 0
        self.last_result: StepResult | None = None
        self._ops: list[Op] = []
        self._expected: list[Expected] = []
        self._known: dict[str, int] = {}  # request id -> how many of its tokens the pool has
        self._failed: str | None = None  # why a Step failed (the client's retries gave up): the pool fell behind
        # Folding: a running request's cache op of this step (its index in _ops), and the index of the last op
        # in _ops that is not a bare cache op (an allocation may join a cache op only after that one).
        self._cache_ops: dict[str, int] = {}
        self._last_barrier = -1

    # ---- recording -----------------------------------------------------------------------------
    def _sync(self, request) -> tuple[list[bytes], int]:
        """The request's block hashes and token count since the pool last heard of it (adding it if new)."""
        request_id = request.request_id
        num_tokens = request.num_tokens
        known = self._known.get(request_id)
        if known is None:
            self._record(AddRequestOp(request_id, block_hashes=list(request.block_hashes), num_tokens=num_tokens,
                                      num_prompt_tokens=request.num_prompt_tokens))
            self._known[request_id] = num_tokens
            return [], 0
        if num_tokens < known:
            raise PoolDiverged(f"request {request_id!r} went from {known} to {num_tokens} tokens; the pool only "
                               f"appends (speculative decoding is refused at start-up)")
        if num_tokens == known:
            return [], 0
        size = self.hash_block_size
        self._known[request_id] = num_tokens
        return list(request.block_hashes[known // size:num_tokens // size]), num_tokens - known

    def _record(self, op: Op, expected: Expected | None = None) -> None:
        if isinstance(op, AllocateOp) and op.cache_tokens and not op.num_new_tokens:
            self._cache_ops[op.request_id] = len(self._ops)
        else:
            self._last_barrier = len(self._ops)
        self._ops.append(op)
        self._expected.append(expected or Expected())

    def _fold(self, op: AllocateOp, expected: Expected) -> bool:
        """Records a running request's allocation inside its cache op of this step (one op instead of two:
        cache_blocks, then allocate_slots) when only bare cache ops follow that one: every op that allocates or
        frees keeps its order, and cache ops commute with allocations (caching touches no free block)."""
        index = self._cache_ops.pop(op.request_id, None)
        if index is None or index < self._last_barrier or op.lookup or op.num_append_tokens:
            return False
        cached = self._ops[index]
        if (cached.num_computed_tokens, cached.num_output_placeholders, cached.num_in_flight_tokens,
                cached.waiting) != (op.num_computed_tokens, op.num_output_placeholders, op.num_in_flight_tokens,
                                    op.waiting):
            return False
        self._ops[index] = replace(op, cache_tokens=cached.cache_tokens, append_block_hashes=cached.append_block_hashes,
                                   num_append_tokens=cached.num_append_tokens)
        self._expected[index] = expected
        self._last_barrier = index  # an allocation now: cache ops before it may no longer take theirs
        return True

    def _op(self, request, **fields) -> AllocateOp:
        hashes, num_append = self._sync(request)
        return AllocateOp(request.request_id, num_computed_tokens=request.num_computed_tokens,
                          append_block_hashes=hashes, num_append_tokens=num_append,
                          num_output_placeholders=request.num_output_placeholders,
                          num_in_flight_tokens=request.num_in_flight_tokens, waiting=request.status in _WAITING,
                          **fields)

    # ---- vLLM's KVCacheManager, answered by the replica, recorded for the pool ----------------------
    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None, num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()):
        if num_external_computed_tokens or num_encoder_tokens:
            raise NotImplementedError("kvservice: external (connector) and encoder tokens are refused at start-up")
        op = self._op(request, num_new_tokens=num_new_tokens, num_lookahead_tokens=num_lookahead_tokens,
                      delay_cache_blocks=delay_cache_blocks, lookup=num_new_computed_tokens > 0,
                      num_new_computed_tokens=num_new_computed_tokens, full_sequence_must_fit=full_sequence_must_fit,
                      reserved_blocks=reserved_blocks, has_scheduled_reqs=has_scheduled_reqs)
        new = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                     num_lookahead_tokens, 0, delay_cache_blocks, 0, full_sequence_must_fit,
                                     reserved_blocks, has_scheduled_reqs, skip_zeroing_group_ids)
        if new is None:
            expected = Expected(OpStatus.NO_SPACE)
        else:  # an admission's reply is its whole table, a running request's its new blocks
            ids = self.get_block_ids(request.request_id) if op.lookup else new.get_block_ids()
            expected = Expected(OpStatus.OK, ids)
        if not self._fold(op, expected):
            self._record(op, expected)
        return new

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        super().cache_blocks(request, num_computed_tokens)
        if self.enable_caching and num_computed_tokens > 0:
            self._record(self._op(request, cache_tokens=num_computed_tokens))

    def free(self, request) -> None:
        super().free(request)
        if self._known.pop(request.request_id, None) is not None:
            self._record(FreeOp(request.request_id))

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self._record(ResetPrefixCacheOp())
        return True

    def pop_blocks_for_free(self, request):
        raise NotImplementedError("kvservice: deferred block frees come with KV connectors, refused at start-up")

    def evict_blocks(self, block_ids) -> None:
        raise NotImplementedError("kvservice: evicting blocks by id comes with KV connectors, refused at start-up")

    # ---- the step's one RPC ----------------------------------------------------------------------
    @property
    def num_pending_ops(self) -> int:
        return len(self._ops)

    def flush(self) -> StepResult | None:
        """Sends the recorded ops as one Step (none: no RPC) and checks the pool answered as the replica did."""
        if not self._ops:
            return None
        if self._failed is not None:
            raise PoolDiverged(f"pool {self.pool_id!r}: an earlier Step failed ({self._failed}); the replica is ahead "
                               f"of the pool: restart the engine (a new pool epoch)")
        ops, expected = self._ops, self._expected
        self._ops, self._expected = [], []
        self._cache_ops.clear()
        self._last_barrier = -1
        try:
            result = self.client.step(self.pool_id, ops)
        except Exception as exc:  # the replica applied them, the pool may not have: nothing may follow
            self._failed = repr(exc)
            raise
        self.num_rpcs += 1
        if len(result.results) != len(ops):
            raise PoolDiverged(f"pool {self.pool_id!r} answered {len(result.results)} results for {len(ops)} ops")
        self.last_result = result
        n = self.num_kv_cache_groups
        for i, (op, want, got) in enumerate(zip(ops, expected, result.results)):
            if got.status != want.status or (want.block_ids is not None
                                             and _ids(got.new_block_ids, n) != _ids(want.block_ids, n)):
                what = f"{type(op).__name__} for {getattr(op, 'request_id', '')!r}"
                raise PoolDiverged(
                    f"pool {self.pool_id!r} answered op {i} ({what}) with {got.status.name} {got.new_block_ids} "
                    f"{got.message!r}; the scheduler's replica with {want.status.name} {want.block_ids}. Another "
                    f"client changed this pool, or the allocator lost state: restart the engine (a new pool epoch)")
        free = self.block_pool.get_num_free_blocks()
        if result.num_free_blocks != free:
            raise PoolDiverged(f"pool {self.pool_id!r} has {result.num_free_blocks} free blocks after the step, the "
                               f"scheduler's replica {free}; restart the engine (a new pool epoch)")
        return result


def _ids(groups, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """Block ids per group; no groups at all means every group empty (the wire leaves them out)."""
    return tuple(tuple(g) for g in groups) if groups else ((),) * num_groups
