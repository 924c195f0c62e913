"""Scheduling one request: append its new tokens, then make room for up to `num_new_tokens`; all or nothing.

Check, then act: `plan` decides (pending transfer? a valid append? within max_model_len? anything left
to compute? the tenant's quota? a prefix to adopt from another pool?) without changing the request or
the pool; `apply` then frees what the window skips (vLLM frees those whether or not the allocation
fits), checks the fit and only then appends and allocates. Nothing is ever undone. The core's fast paths
(one call for a decode step or a fresh admission) are tried first where they apply; they decline
without changing anything.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from kvservice.allocator.keys import client_request_id
from kvservice.allocator.pins import live_pin, no_such_pin
from kvservice.allocator.pools import Pool
from kvservice.allocator.requests import RequestBook
from kvservice.allocator.sessions import Session
from kvservice.allocator.state import AllocatorState
from kvservice.allocator.transfers import Transfer
from kvservice.core import KVCacheBlocks, KVCacheManager, Request
from kvservice.hashing import MAX_TOKEN_ID, token_array
from kvservice.ops import AllocateOp, ExternalSource, OpResult, OpStatus

EMPTY_BLOCKS = KVCacheBlocks(((),))  # an append-only op: scheduled nothing


@dataclass(slots=True)
class Allocation:
    """What one AllocateOp (or one entry of a packed batch) asks for one request."""

    num_computed_tokens: int = 0
    num_new_tokens: int = 0
    append_tokens: int | array | list[int] | None = None  # one token, or several
    append_hashes: list[bytes] | None = None
    num_append: int = 0  # tokens the appended hashes stand for
    num_lookahead: int = 0
    delay_cache_blocks: bool = False
    allow_transfer: bool = False
    external_source: ExternalSource | None = None  # a prefix pinned on another shard

    @classmethod
    def of(cls, op: AllocateOp) -> Allocation:
        tokens = op.append_token_ids
        if tokens is not None and len(tokens) == 1:
            tokens = tokens[0]
        return cls(op.num_computed_tokens, op.num_new_tokens, tokens, op.append_block_hashes, op.num_append_tokens,
                   op.num_lookahead_tokens, op.delay_cache_blocks, op.allow_transfer, op.external_source)

    @property
    def appends(self) -> bool:
        return self.append_tokens is not None or bool(self.num_append)


@dataclass(slots=True)
class Scheduled:
    """The outcome: `blocks` None when refused (`status` says why; nothing changed)."""

    status: OpStatus
    message: str = ""
    blocks: KVCacheBlocks | None = None
    start: int = 0  # where the scheduled tokens start (computed tokens, hits and transferred ones)
    num_scheduled: int = 0
    transfer: Transfer | None = None


@dataclass(slots=True)
class Plan:
    """What `apply` will do, decided by `plan` with nothing changed yet."""

    tokens: int | array | None  # validated tokens to append (None: none, or hashes)
    num_computed: int  # the request's num_computed_tokens before this step's new tokens
    running: bool
    hits: KVCacheBlocks | None
    num_hit: int
    source: tuple[Pool | ExternalSource, int] | None  # (pool here or pinned elsewhere, tokens it holds) to copy
    start: int
    num_new: int
    total_computed: int  # allocate_slots' view: computed + hit tokens (transferred ones are new to it)
    num_need: int  # tokens that need a slot after this step (lookahead included)
    num_tokens: int  # the request's tokens once this step's are appended


def blocks_to_allocate(manager: KVCacheManager, req: Request, plan: Plan, num_lookahead: int) -> int:
    """Free blocks `apply`'s allocation will consume (read-only): what allocate_slots will count once the
    request has the plan's computed and appended tokens."""
    transferred = plan.start - plan.num_computed - plan.num_hit
    return manager.num_blocks_needed(req, transferred + plan.num_new, plan.num_hit, plan.hits, num_lookahead,
                                     num_computed_tokens=plan.num_computed, num_tokens=plan.num_tokens)


def hash_append_refusal(req: Request, hashes: list[bytes] | None, num_append: int) -> str | None:
    """Why `req.append_block_hashes(hashes, num_append)` would refuse (None: it would not)."""
    hashes = hashes or []
    num_tokens = req.num_tokens + num_append
    if req.unhashed:
        return (f"request {client_request_id(req.request_id)!r} was added without block hashes (its pool does not "
                f"cache prefixes): append none") if hashes else None
    expected = num_tokens // req.block_size - len(req.block_hashes)
    if len(hashes) != expected and not (req.hashes_may_lag and len(hashes) <= expected):
        return (f"request {client_request_id(req.request_id)!r}: {num_tokens} tokens need "
                f"{'at most ' if req.hashes_may_lag else ''}{expected} new block hashes at block size "
                f"{req.block_size}, got {len(hashes)}")
    size = req.hash_bytes
    for i, h in enumerate(hashes):
        if not isinstance(h, bytes) or len(h) != size:
            return f"block_hashes[{i}] must be {size} bytes in this pool's hash spec, got {h!r:.40}"
    return None


class Scheduler:
    def __init__(self, state: AllocatorState, book: RequestBook) -> None:
        self.state = state
        self.book = book

    # ---- the AllocateOp ------------------------------------------------------------------------
    def allocate_op(self, pool: Pool, session: Session, key: str, op: AllocateOp, admin: bool = False) -> OpResult:
        request_id = op.request_id
        req = pool.requests.get(key)
        if req is None:
            return self.book.missing(pool, key, request_id)
        source = op.external_source
        if source is not None and not self._source_is_live(source, session.tenant, admin):
            return OpResult(request_id, OpStatus.NOT_FOUND, no_such_pin(source), (), req.num_computed_tokens, 0,
                            req.num_tokens)
        a = Allocation.of(op)
        if (a.num_new_tokens and (a.append_tokens is None or type(a.append_tokens) is int)
                and a.append_hashes is None and not a.num_append and not a.delay_cache_blocks
                and a.external_source is None and not op.cache_tokens):
            fast = self._fast_path(pool, session.tenant, key)
            new_blocks = fast.allocate_running(req, a.num_computed_tokens, a.append_tokens, a.num_new_tokens,
                                               a.num_lookahead) if fast is not None else None
            if new_blocks is not None:
                computed = a.num_computed_tokens
                return OpResult(request_id, OpStatus.OK, "", ([b.block_id for b in new_blocks],), computed,
                                min(a.num_new_tokens, req.num_tokens - computed), req.num_tokens)
        s = self.schedule(pool, session, key, req, a)
        if s.blocks is None:
            return OpResult(request_id, s.status, s.message, (), s.start, s.num_scheduled, req.num_tokens)
        if op.cache_tokens and pool.manager.coordinator.is_running(key):
            # after delay_cache_blocks: the blocks' bytes are written now (a store pool's save), so they hit
            pool.manager.cache_blocks(req, min(op.cache_tokens, req.num_computed_tokens))
        groups = s.blocks.blocks
        if len(groups) == 1:
            ids = ([b.block_id for b in groups[0]],) if groups[0] else ([],)
        else:
            ids = tuple([b.block_id for b in g] for g in groups)
        return OpResult(request_id, OpStatus.OK, "", ids, s.start, s.num_scheduled, req.num_tokens,
                        s.transfer.order() if s.transfer is not None else None, replaced=s.blocks.replaced)

    def _source_is_live(self, source: ExternalSource, tenant: str, admin: bool) -> bool:
        src = self.state.pools.get(source.src_pool_id)
        # A pool not held here is another shard's: the server checked the pin there before this command
        # (pins.check_sources, then ShardRouter.pin_is_live), and a replay applies what was checked then.
        return src is None or live_pin(src, source, tenant, admin) is not None

    def _fast_path(self, pool: Pool, tenant: str, key: str):
        """The core's fast paths, unless the service's own rules apply: a tenant quota needs per-allocation
        accounting, a request waiting for a transfer must not run."""
        quotas = self.state.usage.quotas
        if (quotas and tenant in quotas) or (pool.pool_id, key) in self.state.transfers.by_dst:
            return None
        return pool.manager.fast_path

    # ---- one request ---------------------------------------------------------------------------
    def schedule(self, pool: Pool, session: Session, key: str, req: Request, a: Allocation) -> Scheduled:
        if a.num_new_tokens and not a.appends and not a.allow_transfer:
            admitted = self._fast_admit(pool, session.tenant, key, req, a)
            if admitted is not None:
                return admitted
        plan = self.plan(pool, session, key, req, a)
        if isinstance(plan, Scheduled):
            return plan
        return self.apply(pool, session, key, req, a, plan)

    def _fast_admit(self, pool: Pool, tenant: str, key: str, req: Request, a: Allocation) -> Scheduled | None:
        """A fresh admission in one core call (exactly get_computed_blocks + allocate_slots), or None."""
        fast = self._fast_path(pool, tenant, key)
        if fast is None or pool.manager.coordinator.is_running(key):
            return None
        admitted = fast.admit(req, a.num_new_tokens, a.num_lookahead, a.delay_cache_blocks)
        if admitted is None:
            return None
        table, num_hit = admitted
        num_new = min(a.num_new_tokens, req.num_tokens - num_hit)
        if table is None:
            return self._no_space(pool, key, num_new, num_hit)
        req.num_computed_tokens = num_hit
        return Scheduled(OpStatus.OK, "", KVCacheBlocks((table,)), num_hit, num_new)

    def plan(self, pool: Pool, session: Session, key: str, req: Request, a: Allocation) -> Plan | Scheduled:
        """Decides what `apply` does, or the refusal; changes nothing (but the lookup's hit statistics)."""
        state = self.state
        transfers = state.transfers
        pending = transfers.pending(pool.pool_id, key) if transfers.by_dst else None
        if pending is not None:
            return Scheduled(OpStatus.FAILED_PRECONDITION, f"request {client_request_id(key)!r} waits for transfer "
                                                           f"{pending}: commit or abort it first")
        tokens, num_tokens = None, req.num_tokens
        if a.appends:
            refused = self._append_refusal(req, key, a)
            if refused is not None:
                return Scheduled(OpStatus.FAILED_PRECONDITION, refused)
            if a.append_tokens is not None:
                tokens = a.append_tokens
                if type(tokens) is not int and not (type(tokens) is array and tokens.typecode == "I"):
                    tokens = token_array(tokens, "append_token_ids")  # in-process callers: validated here
                num_tokens += 1 if type(tokens) is int else len(tokens)
            else:
                num_tokens += a.num_append
            if num_tokens > pool.spec.max_model_len:
                return Scheduled(OpStatus.FAILED_PRECONDITION, f"request {client_request_id(key)!r} would hold "
                                 f"{num_tokens} tokens > max_model_len {pool.spec.max_model_len}")
        manager = pool.manager
        running = manager.coordinator.is_running(key)
        if running:
            if a.num_computed_tokens > num_tokens:
                return Scheduled(OpStatus.FAILED_PRECONDITION, f"num_computed_tokens {a.num_computed_tokens} > the "
                                                               f"request's {num_tokens} tokens")
            num_computed = a.num_computed_tokens
        else:
            num_computed = 0 if a.num_new_tokens else req.num_computed_tokens
        hits, num_hit, source, view = None, 0, None, req
        if not running and a.num_new_tokens:
            if a.appends:  # the lookup needs the appended tokens' hashes: decide on a copy
                view = self._with_append(req, tokens, a)
            hits, num_hit = manager.get_computed_blocks(view)
            if a.external_source is not None:
                source = transfers.external(pool, view, num_hit, a.external_source)
            elif a.allow_transfer:
                source = transfers.source(state.pools, pool, view, num_hit)
        # Tokens copied from the source pool are scheduled like hits: computed before this step's tokens.
        transferred = source[1] - num_hit if source is not None else 0
        start = num_computed + num_hit + transferred
        max_len = manager.max_model_len
        total_computed = min(num_computed + num_hit, max_len)
        if a.num_new_tokens == 0:
            return Plan(tokens, num_computed, running, None, 0, None, start, 0, total_computed, 0, num_tokens)
        num_new = min(a.num_new_tokens, num_tokens - start)
        if num_new <= 0:
            return Scheduled(OpStatus.FAILED_PRECONDITION, f"request {client_request_id(key)!r} has no uncomputed "
                             f"tokens (num_tokens {num_tokens}, num_computed_tokens {start}); append tokens first",
                             None, start)
        num_need = min(total_computed + transferred + num_new + a.num_lookahead, max_len)
        tenant = session.tenant
        quota = state.usage.quotas.get(tenant) if state.usage.quotas else None
        plan = Plan(tokens, num_computed, running, hits, num_hit, source, start, num_new, total_computed, num_need,
                    num_tokens)
        if quota is not None:
            needed = blocks_to_allocate(manager, req, plan, a.num_lookahead)
            used = state.usage.used(tenant)
            if used + needed > quota:
                return Scheduled(OpStatus.RESOURCE_EXHAUSTED, f"tenant {tenant!r} block quota: {used} held + "
                                 f"{needed} needed > quota {quota}", None, start)
        return plan

    def apply(self, pool: Pool, session: Session, key: str, req: Request, a: Allocation, plan: Plan) -> Scheduled:
        manager = pool.manager
        if plan.num_new == 0:  # append only
            self._append(req, plan.tokens, a)
            if plan.running:
                req.num_computed_tokens = plan.num_computed
            return Scheduled(OpStatus.OK, "", EMPTY_BLOCKS, plan.start, 0)
        # What no group reads again is freed first (fewer cached blocks evicted), fit or not, as vLLM does.
        manager.coordinator.remove_skipped_blocks(key, max(0, plan.total_computed - req.num_in_flight_tokens),
                                                  req.num_prompt_tokens)
        needed = blocks_to_allocate(manager, req, plan, a.num_lookahead)
        transferred = plan.start - plan.num_computed - plan.num_hit
        if needed > manager.block_pool.get_num_free_blocks():
            return self._no_space(pool, key, transferred + plan.num_new, plan.start)
        self._append(req, plan.tokens, a)
        req.num_computed_tokens = plan.num_computed
        new = manager.allocate_slots(req, transferred + plan.num_new, plan.num_hit, plan.hits, a.num_lookahead,
                                     a.delay_cache_blocks or transferred > 0)
        if new is None:
            raise AssertionError(f"allocate_slots refused {client_request_id(key)!r} after the fit check")
        transfer = None
        if not plan.running:
            req.num_computed_tokens = plan.num_hit + transferred
            # Admission: the engine has no row yet, so it gets the whole table (hits included).
            new = KVCacheBlocks(manager.coordinator.get_blocks(key), new.replaced)
            if plan.source is not None:
                src, src_hit = plan.source
                transfers = self.state.transfers
                if isinstance(src, ExternalSource):
                    transfer = transfers.open_external(session.session_id, src, pool, key, plan.num_hit)
                else:
                    transfer = transfers.open(session.session_id, src, src_hit, pool, key, req, plan.num_hit)
        if self.state.usage.quotas:
            self.state.usage.update(session.tenant, pool, key)
        return Scheduled(OpStatus.OK, "", new, plan.start, plan.num_new, transfer)

    # ---- appends -------------------------------------------------------------------------------
    @staticmethod
    def _append_refusal(req: Request, key: str, a: Allocation) -> str | None:
        if a.num_append and not req.has_token_ids:
            return hash_append_refusal(req, a.append_hashes, a.num_append)
        if a.append_tokens is not None and req.has_token_ids:
            tokens = a.append_tokens
            if type(tokens) is int and not 0 <= tokens <= MAX_TOKEN_ID:
                return f"output token id {tokens} is not a token id in [0, 2**32)"
            return None
        kind = "token ids" if req.has_token_ids else "block hashes"
        return f"request {client_request_id(key)!r} was added with {kind}: append {kind}"

    @staticmethod
    def _append(req: Request, tokens: int | array | None, a: Allocation) -> None:
        if tokens is not None:
            req.append_output_token_ids(tokens)
        elif a.num_append:
            req.append_block_hashes(a.append_hashes or [], a.num_append)

    def _with_append(self, req: Request, tokens: int | array | None, a: Allocation) -> Request:
        view = req.fork(req.request_id)
        view.num_preemptions = req.num_preemptions  # the lookup's statistics tell preempted requests apart
        self._append(view, tokens, a)
        return view

    @staticmethod
    def _no_space(pool: Pool, key: str, num_tokens: int, start: int) -> Scheduled:
        free = pool.manager.block_pool.get_num_free_blocks()
        return Scheduled(OpStatus.NO_SPACE, f"pool {pool.pool_id!r} has {free} free blocks, not enough for "
                         f"{num_tokens} more tokens of {client_request_id(key)!r}", None, start)
