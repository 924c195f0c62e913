"""The allocator: a deterministic state machine over pools, sessions and the event log.

Given the same sequence of calls it reaches the same state (block for block), which is what the
write-ahead log replays. No I/O and no clock of its own: times are arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from kvservice.core import AllBlocksCleared, KVCacheBlocks, Request
from kvservice.core.invariants import InvariantError, check_invariants
from kvservice.core.kv_cache_manager import DecodeBatchOutput
from kvservice.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvservice.eventlog import EventLog
from kvservice.hashing import DEFAULT_HASH_BLOCK_SIZE, DEFAULT_HASH_SEED, hash_prompt, spec_fingerprint
from kvservice.ops import (
    AddRequestOp,
    AdmitBatchOp,
    AllocateOp,
    DecodeBatchOp,
    DecodeBatchResult,
    ForkOp,
    FreeOp,
    Op,
    OpResult,
    OpStatus,
    StepResult,
)
from kvservice.pools import SEP, Pool, PoolSpec, TenantUsage, client_request_id, namespace, request_key
from kvservice.sessions import Session, SessionTable
from kvservice.transfers import TransferBook

logger = logging.getLogger(__name__)
EMPTY_BLOCKS = KVCacheBlocks(((),))  # an append-only op: scheduled nothing
_BLOCK_ID = attrgetter("block_id")


@dataclass(slots=True)
class RegisterResult:
    pool_id: str
    epoch: int
    new_epoch: bool
    hash_block_size: int
    hash_seed: str
    num_requests_failed: int
    scheduler_block_size: int


@dataclass(slots=True)
class PoolHit:
    pool_id: str
    num_cached_tokens: int
    num_free_blocks: int


class Allocator:
    def __init__(self, hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE, hash_seed: str = DEFAULT_HASH_SEED,
                 session_ttl_s: float = 30.0, event_retention: int = 100_000,
                 quotas: dict[str, int] | None = None, min_transfer_tokens: int = 64,
                 max_requests_per_session: int = 1_000_000, max_pool_blocks: int = 1 << 22) -> None:
        self.hash_block_size = hash_block_size
        self.hash_seed = hash_seed
        self.fingerprint = spec_fingerprint(hash_seed, hash_block_size)
        self.pools: dict[str, Pool] = {}
        self.sessions = SessionTable(session_ttl_s)
        self.events = EventLog(event_retention)
        self.usage = TenantUsage(quotas or {})
        self.transfers = TransferBook(min_transfer_tokens)
        self.max_requests_per_session = max_requests_per_session
        self.max_pool_blocks = max_pool_blocks
        self.lease_expiries = 0

    # ---- sessions ------------------------------------------------------------------------------
    def open_session(self, session_id: str, tenant: str, client_name: str, now: float) -> Session:
        return self.sessions.open(session_id, tenant, client_name, now)

    def heartbeat(self, session_id: str, tenant: str, now: float) -> Session:
        return self.sessions.get(session_id, tenant, now)

    def expire_sessions(self, now: float) -> list[str]:
        """Frees the requests of every session whose lease lapsed; returns their ids."""
        expired = self.sessions.expired(now)
        for session in expired:
            self.close_session(session.session_id)
        return [s.session_id for s in expired]

    def close_session(self, session_id: str) -> int:
        session = self.sessions.sessions.pop(session_id)
        for transfer in self.transfers.of_session(session_id):
            self._abort_transfer(transfer)
        num_freed = 0
        for pool_id, keys in session.requests.items():
            pool = self.pools.get(pool_id)
            if pool is None:
                continue
            for key in sorted(keys):
                if key in pool.requests:
                    self._free(pool, session.tenant, key)
                    num_freed += 1
            self._drain(pool)
        self.lease_expiries += 1
        logger.info("session %s closed: %d requests freed", session_id, num_freed)
        return num_freed

    # ---- transfers -----------------------------------------------------------------------------
    def commit_transfer(self, session: Session, sequence: int, pool: Pool, transfer_id: str,
                        abort: bool) -> StepResult:
        """Commit: the destination's copied blocks become cached. Abort: the destination request is freed.
        Either way the source pins drop."""
        stored = self.sessions.check_sequence(session, sequence)
        if stored is not None:
            return stored  # type: ignore[return-value]
        transfer = self.transfers.transfers.get(transfer_id)
        if transfer is None or transfer.dst_pool != pool.pool_id or not self._same_tenant(session, transfer):
            result = OpResult(transfer_id, OpStatus.NOT_FOUND,
                              f"no pending transfer {transfer_id!r} into pool {pool.pool_id!r}")
        elif abort:
            request_id = client_request_id(transfer.dst_key)
            self._abort_transfer(transfer)
            result = OpResult(request_id, OpStatus.OK, f"transfer {transfer_id} aborted; request freed")
        else:
            self.transfers.close(transfer, self.pools, commit=True)
            result = OpResult(client_request_id(transfer.dst_key), OpStatus.OK)
        for p in {transfer.src_pool, transfer.dst_pool} if transfer is not None else ():
            if p in self.pools:
                self._drain(self.pools[p])
        step = StepResult(sequence, [result], [])
        self._commit(session, sequence, step)
        return step

    def _same_tenant(self, session: Session, transfer) -> bool:
        owner = self.sessions.sessions.get(transfer.session_id)
        return owner is None or owner.tenant == session.tenant

    def _abort_transfer(self, transfer, reason: str = "") -> None:
        """Drops the source pins and frees the destination request (it never got its prefix)."""
        self.transfers.close(transfer, self.pools, commit=False)
        dst = self.pools.get(transfer.dst_pool)
        if dst is not None and transfer.dst_key in dst.requests:
            key = transfer.dst_key
            tenant = key.split(SEP, 1)[0] if SEP in key else ""
            self._free(dst, tenant, key)
            if reason:
                dst.bury(key, f"transfer {transfer.transfer_id} aborted: {reason}; re-add the request")
            self._drain(dst)

    # ---- pools ---------------------------------------------------------------------------------
    def register_pool(self, session: Session, sequence: int, spec: PoolSpec, fingerprint: str,
                      admin: bool = True) -> RegisterResult:
        """Registers (or re-registers) a pool. A pool belongs to the tenant that registered it: only that
        tenant or an admin may start a new epoch of it (which drops its memory)."""
        stored = self.sessions.check_sequence(session, sequence)
        if stored is not None:
            return stored  # type: ignore[return-value]
        if spec.config.num_blocks > self.max_pool_blocks:
            raise InvalidArgument("config.num_blocks", spec.config.num_blocks,
                                  f"exceeds this allocator's limit of {self.max_pool_blocks} blocks per pool "
                                  f"(kvservice serve --max-pool-blocks)")
        existing = self.pools.get(spec.pool_id)
        if existing is not None and not admin and existing.owner_tenant != session.tenant:
            raise PermissionDenied(f"pool {spec.pool_id!r} belongs to another tenant; only it or an admin may "
                                   f"re-register it")
        if fingerprint != self.fingerprint:
            raise FailedPrecondition(
                f"hash_fingerprint {fingerprint!r} does not match the allocator's {self.fingerprint!r} "
                f"(seed {self.hash_seed!r}, hash block size {self.hash_block_size}); hash with the same spec")
        current = self.pools.get(spec.pool_id)
        if current is not None and spec.epoch < current.epoch:
            raise FailedPrecondition(f"pool {spec.pool_id!r}: epoch {spec.epoch} is older than the registered "
                                     f"epoch {current.epoch}")
        if current is not None and spec.epoch == current.epoch:
            if not current.spec.same_shape(spec):
                raise FailedPrecondition(f"pool {spec.pool_id!r} is registered at epoch {spec.epoch} with another "
                                         f"config; register with a higher epoch to replace it")
            result = self._register_result(current, False, 0)
        else:
            pool = Pool(spec, self.hash_block_size, self.hash_seed)  # validates the config
            pool.owner_tenant = current.owner_tenant if current is not None else session.tenant
            failed = self._retire(current, pool) if current is not None else 0
            self.pools[spec.pool_id] = pool
            result = self._register_result(pool, True, failed)
        self._commit(session, sequence, result)
        return result

    def _register_result(self, pool: Pool, new_epoch: bool, failed: int) -> RegisterResult:
        return RegisterResult(pool.pool_id, pool.epoch, new_epoch, pool.hash_block_size, self.hash_seed, failed,
                              pool.manager.scheduler_block_size)

    def _retire(self, old: Pool, new: Pool) -> int:
        """A new epoch: the workers' memory is gone, so every in-flight request fails (and every transfer
        from or to it)."""
        for transfer in self.transfers.involving(old.pool_id):
            self._abort_transfer(transfer, reason=f"pool {old.pool_id!r} restarted (epoch {new.epoch})")
        new_epoch = new.epoch
        new.tombstones = old.tombstones
        reason = (f"pool {old.pool_id!r} started epoch {new_epoch} (was {old.epoch}): its KV memory is gone; "
                  f"re-add the request")
        for key in list(old.requests):
            session = self.sessions.sessions.get(old.owner.get(key, ""))
            if session is not None:
                session.disown(old.pool_id, key)
            old.bury(key, reason)
        self.usage.drop_pool(old.pool_id)
        self.events.extend(old.pool_id, [*old.manager.take_events(), AllBlocksCleared()])
        old.manager.block_pool.release()
        logger.warning("pool %s: epoch %d -> %d, %d requests failed", old.pool_id, old.epoch, new_epoch,
                       len(old.requests))
        return len(old.requests)

    def bump_epoch(self, pool_id: str) -> None:
        """Forces a new epoch (stale recovery, DESIGN §6): same config, fresh memory."""
        old = self.pools[pool_id]
        spec = PoolSpec(**{f: getattr(old.spec, f) for f in PoolSpec.__slots__})
        spec.epoch = old.epoch + 1
        pool = Pool(spec, self.hash_block_size, self.hash_seed)
        pool.owner_tenant = old.owner_tenant
        self._retire(old, pool)
        self.pools[pool_id] = pool

    def pool(self, pool_id: str) -> Pool:
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"pool {pool_id!r} is not registered; call RegisterPool first")
        return pool

    # ---- steps ---------------------------------------------------------------------------------
    def step(self, session: Session, sequence: int, pool: Pool, ops: Sequence[Op]) -> StepResult:
        """Applies ops in order (validated beforehand); per-op outcomes are statuses."""
        stored = self.sessions.check_sequence(session, sequence)
        if stored is not None:
            return stored  # type: ignore[return-value]
        results = []
        for op in ops:
            if isinstance(op, AllocateOp):
                results.append(self._allocate(pool, session, op))
            elif isinstance(op, AddRequestOp):
                results.append(self._add(pool, session, op))
            elif isinstance(op, DecodeBatchOp):
                results.append(self._decode_batch(pool, session, op))
            elif isinstance(op, AdmitBatchOp):
                results.append(self._admit_batch(pool, session, op))
            elif isinstance(op, FreeOp):
                results.append(self._free_op(pool, session, op))
            else:
                results.append(self._fork(pool, session, op))
        result = StepResult(sequence, results, pool.manager.take_block_copies())
        self._drain(pool)
        self._commit(session, sequence, result)
        return result

    def _commit(self, session: Session, sequence: int, reply: object) -> None:
        session.last_sequence = sequence
        session.last_reply = reply

    def _drain(self, pool: Pool) -> None:
        events = pool.manager.take_events()
        if events:
            self.events.extend(pool.pool_id, events)

    def _missing(self, pool: Pool, key: str, request_id: str) -> OpResult:
        reason = pool.tombstones.get(key)
        if reason is not None:
            return OpResult(request_id, OpStatus.EPOCH_CHANGED, reason)
        return OpResult(request_id, OpStatus.NOT_FOUND, f"request {request_id!r} not found in pool {pool.pool_id!r}")

    def _session_full(self, session: Session, request_id: str) -> OpResult | None:
        held = sum(map(len, session.requests.values()))
        if held < self.max_requests_per_session:
            return None
        return OpResult(request_id, OpStatus.RESOURCE_EXHAUSTED,
                        f"session {session.session_id!r} holds {held} requests, the limit is "
                        f"{self.max_requests_per_session}; free some first")

    def _add(self, pool: Pool, session: Session, op: AddRequestOp) -> OpResult:
        tenant = session.tenant
        key = f"{tenant}{SEP}{op.request_id}" if tenant else op.request_id  # request_key, inline: per op
        refused = self._refuse_add(pool, session, key, op.request_id)
        if refused is not None:
            return refused
        ns = namespace(tenant)
        if op.block_hashes is not None:
            req = Request.from_block_hashes(key, op.block_hashes, op.num_tokens, pool.hash_block_size,
                                            lora_name=op.lora_name, namespace=ns)
        else:
            req = Request(key, op.token_ids, pool.hash_block_size, op.cache_salt, op.lora_name, self.hash_seed,
                          mm_items=op.mm_items, namespace=ns)
        self._track(pool, session, key, req)
        return OpResult(op.request_id, num_tokens=req.num_tokens)

    def _refuse_add(self, pool: Pool, session: Session, key: str, request_id: str) -> OpResult | None:
        """Why a request cannot be added (ALREADY_EXISTS, the session's limit), or None."""
        if key in pool.requests:
            return OpResult(request_id, OpStatus.ALREADY_EXISTS,
                            f"request {request_id!r} already exists in pool {pool.pool_id!r}")
        return self._session_full(session, request_id)

    @staticmethod
    def _track(pool: Pool, session: Session, key: str, req: Request) -> None:
        """A new request of the pool, owned by the session."""
        pool.requests[key] = req
        pool.owner[key] = session.session_id
        pool.tombstones.pop(key, None)
        session.own(pool.pool_id, key)

    def _allocate(self, pool: Pool, session: Session, op: AllocateOp) -> OpResult:
        tenant = session.tenant
        request_id = op.request_id
        key = f"{tenant}{SEP}{request_id}" if tenant else request_id
        req = pool.requests.get(key)
        if req is None:
            return self._missing(pool, key, request_id)
        tokens = op.append_token_ids
        if tokens is not None and len(tokens) == 1:
            tokens = tokens[0]
        if (op.num_new_tokens and (tokens is None or isinstance(tokens, int)) and op.append_block_hashes is None
                and not op.num_append_tokens and not op.delay_cache_blocks):
            running = self._running_path(pool, session.tenant, key)
            new_blocks = running(req, op.num_computed_tokens, tokens, op.num_new_tokens,
                                 op.num_lookahead_tokens) if running is not None else None
            if new_blocks is not None:
                computed = op.num_computed_tokens
                return OpResult(request_id, OpStatus.OK, "", ([b.block_id for b in new_blocks],), computed,
                                min(op.num_new_tokens, req.num_tokens - computed), req.num_tokens)
        status, message, new, start, num_new, transfer = self._schedule(
            pool, session, key, req, op.num_computed_tokens, op.num_new_tokens, tokens, op.append_block_hashes,
            op.num_append_tokens, op.num_lookahead_tokens, op.delay_cache_blocks, op.allow_transfer)
        if new is None:
            return OpResult(request_id, status, message, (), start, num_new, req.num_tokens)
        groups = new.blocks
        if len(groups) == 1:
            ids = ([b.block_id for b in groups[0]],) if groups[0] else ([],)
        else:
            ids = tuple([b.block_id for b in g] for g in groups)
        return OpResult(request_id, OpStatus.OK, "", ids, start, num_new, req.num_tokens,
                        transfer.order() if transfer is not None else None, replaced=new.replaced)

    def _decode_batch(self, pool: Pool, session: Session, op: DecodeBatchOp) -> OpResult:
        """Entry i is exactly the AllocateOp it stands for; outcomes are packed. Runs of common entries
        (running, nothing shared, room in the pool) go through the core's batch decode path; the
        general path decides the rest, in order."""
        tenant = session.tenant
        requests = pool.requests
        n = len(op.request_ids)
        statuses = bytearray(n)
        out = DecodeBatchOutput()
        failures: list[OpResult] = []
        replaced: list[tuple[int, int, int, int]] = []
        num_groups = len(pool.spec.config.groups)
        tokens, computed = op.append_token_ids, op.num_computed_tokens
        budget, lookahead = op.num_new_tokens or 1, op.num_lookahead_tokens
        keys = [f"{tenant}{SEP}{r}" for r in op.request_ids] if tenant else op.request_ids
        reqs = list(map(requests.get, keys))
        batch, batch_reqs = self._batch_path(pool, tenant, keys, reqs)
        i = 0
        while i < n:
            if batch is not None:
                i = batch(batch_reqs, computed, tokens, budget, lookahead, i, out)
                if i == n:
                    break
            request_id, key, req = op.request_ids[i], keys[i], reqs[i]
            if req is None:
                failure = self._missing(pool, key, request_id)
                status, new, start, num_new = failure.status, None, 0, 0
            else:
                status, message, new, start, num_new, _ = self._schedule(
                    pool, session, key, req, computed[i], budget, None if tokens is None else tokens[i], None, 0,
                    lookahead, False, False)
                if new is None:
                    failure = OpResult(request_id, status, message, (), start, num_new, req.num_tokens)
            if new is None:
                statuses[i] = status
                failures.append(failure)
                out.num_new_blocks.extend([0] * num_groups)
            else:
                self._pack(out, replaced, i, new, num_groups)
            out.num_computed.append(start)
            out.num_scheduled.append(num_new)
            i += 1
        result = DecodeBatchResult(bytes(statuses), out.num_new_blocks, out.new_block_ids, out.num_computed,
                                   out.num_scheduled, failures, num_groups, replaced)
        return OpResult("", OpStatus.OK, "", (), 0, 0, 0, None, result)

    def _admit_batch(self, pool: Pool, session: Session, op: AdmitBatchOp) -> OpResult:
        """Entry i is exactly AddRequestOp and, when that added the request, AllocateOp, through the
        steps those take for a new request (`_refuse_add`, `_track`, `_schedule`); outcomes are packed,
        each admitted request's whole table in the new blocks."""
        tenant = session.tenant
        ns = namespace(tenant)
        n = len(op.request_ids)
        statuses = bytearray(n)
        out = DecodeBatchOutput()
        computed, scheduled = out.num_computed, out.num_scheduled
        failures: list[OpResult] = []
        replaced: list[tuple[int, int, int, int]] = []
        num_groups = len(pool.spec.config.groups)
        budgets, salts, loras, lookahead = op.num_new_tokens, op.cache_salts, op.lora_names, op.num_lookahead_tokens
        for i, request_id in enumerate(op.request_ids):
            key = f"{tenant}{SEP}{request_id}" if tenant else request_id
            failure = self._refuse_add(pool, session, key, request_id)
            if failure is None:
                prompt = op.prompts[i]
                req = Request(key, prompt, pool.hash_block_size, salts[i] if salts else None,
                              loras[i] if loras else None, self.hash_seed, namespace=ns)
                self._track(pool, session, key, req)
                status, message, new, start, num_new, _ = self._schedule(
                    pool, session, key, req, 0, len(prompt) if budgets is None else budgets[i], None, None, 0,
                    lookahead, False, False)
                if new is None:
                    failure = OpResult(request_id, status, message, (), start, num_new, req.num_tokens)
            if failure is not None:
                statuses[i] = failure.status
                failures.append(failure)
                out.num_new_blocks.extend([0] * num_groups)
                computed.append(failure.num_computed_tokens)
                scheduled.append(failure.num_scheduled_tokens)
                continue
            self._pack(out, replaced, i, new, num_groups)
            computed.append(start)
            scheduled.append(num_new)
        result = DecodeBatchResult(bytes(statuses), out.num_new_blocks, out.new_block_ids, computed, scheduled,
                                   failures, num_groups, replaced)
        return OpResult("", OpStatus.OK, "", (), 0, 0, 0, None, result)

    @staticmethod
    def _pack(out: DecodeBatchOutput, replaced: list, i: int, new: KVCacheBlocks, num_groups: int) -> None:
        """Entry i's blocks into a packed batch result: a count and the ids per group, its swaps."""
        groups = new.blocks
        for g in range(num_groups):
            table = groups[g] if g < len(groups) else ()  # nothing scheduled: one empty group
            out.num_new_blocks.append(len(table))
            out.new_block_ids.extend(map(_BLOCK_ID, table))
        for g, index, block_id in new.replaced:
            replaced.append((i, g, index, block_id))

    def _batch_path(self, pool: Pool, tenant: str, keys: Sequence[str], reqs: list[Request | None]):
        """The core's batch decode path and the requests it may take (None: the general path decides),
        unless something of the service's own is in the way: a tenant quota needs per-allocation
        accounting, a request waiting for a transfer must not run."""
        if self.usage.quotas and tenant in self.usage.quotas:
            return None, reqs
        if self.transfers.by_dst:
            pending = self.transfers.by_dst
            reqs = [None if (pool.pool_id, key) in pending else req for key, req in zip(keys, reqs)]
        return pool.manager.allocate_running_batch, reqs

    def _admit_path(self, pool: Pool, tenant: str):
        """The core's one-call admission, unless a tenant quota needs its per-allocation accounting."""
        if self.usage.quotas and tenant in self.usage.quotas:
            return None
        return pool.manager.admit

    def _running_path(self, pool: Pool, tenant: str, key: str):
        """The core's one-call decode step for one request, unless the service's own rules apply (see
        `_batch_path`)."""
        if (self.usage.quotas and tenant in self.usage.quotas) or (pool.pool_id, key) in self.transfers.by_dst:
            return None
        return pool.manager.allocate_running

    def _schedule(self, pool: Pool, session: Session, key: str, req: Request, num_computed_tokens: int,
                  num_new_tokens: int, append_tokens, append_hashes, num_append: int, num_lookahead: int,
                  delay_cache_blocks: bool, allow_transfer: bool):
        """Appends, then schedules up to `num_new_tokens`; all or nothing. An admission may adopt a prefix
        cached on another pool (`allow_transfer`): its tokens count as computed once the copy ran.

        Returns:
            (status, message, new blocks or None, where the new tokens start, how many were scheduled,
            the transfer opened or None).
        """
        tenant = session.tenant
        manager = pool.manager
        pending = self.transfers.pending(pool.pool_id, key) if self.transfers.by_dst else None
        if pending is not None:
            return (OpStatus.FAILED_PRECONDITION, f"request {client_request_id(key)!r} waits for transfer "
                    f"{pending}: commit or abort it first", None, 0, 0, None)
        num_tokens_before = req.num_tokens
        computed_before = req.num_computed_tokens
        if append_tokens is not None or num_append:
            failure = self._append(req, key, append_tokens, append_hashes, num_append)
            if failure is not None:
                return OpStatus.FAILED_PRECONDITION, failure, None, 0, 0, None
            if req.num_tokens > pool.spec.max_model_len:
                num_tokens = req.num_tokens
                req.truncate(num_tokens_before)
                return (OpStatus.FAILED_PRECONDITION, f"request {client_request_id(key)!r} would hold {num_tokens} "
                        f"tokens > max_model_len {pool.spec.max_model_len}", None, 0, 0, None)
        running = key in manager.coordinator.managers[0].num_cached_block
        hits, num_hit = None, 0
        if running:
            if num_computed_tokens > req.num_tokens:
                req.truncate(num_tokens_before)
                return (OpStatus.FAILED_PRECONDITION, f"num_computed_tokens {num_computed_tokens} > the request's "
                        f"{req.num_tokens} tokens", None, 0, 0, None)
            req.num_computed_tokens = num_computed_tokens
        elif num_new_tokens:
            req.num_computed_tokens = 0
            admit = None if allow_transfer else self._admit_path(pool, tenant)
            admitted = admit(req, num_new_tokens, num_lookahead, delay_cache_blocks) if admit is not None else None
            if admitted is not None:  # the core's one-call admission: the same as the steps below
                table, num_hit = admitted
                num_new = min(num_new_tokens, req.num_tokens - num_hit)
                if table is None:
                    self._undo(req, num_tokens_before, computed_before)
                    return self._no_space(pool, key, num_new, num_hit)
                req.num_computed_tokens = num_hit
                return OpStatus.OK, "", KVCacheBlocks((table,)), num_hit, num_new, None
            hits, num_hit = manager.get_computed_blocks(req)
        source = self.transfers.source(self.pools, pool, req, num_hit) if allow_transfer and not running else None
        # Tokens copied from the source pool are scheduled like hits: computed before this step's tokens.
        transferred = source[1] - num_hit if source is not None else 0
        start = req.num_computed_tokens + num_hit + transferred
        if num_new_tokens == 0:
            return OpStatus.OK, "", EMPTY_BLOCKS, start, 0, None
        num_new = min(num_new_tokens, req.num_tokens - start)
        if num_new <= 0:
            self._undo(req, num_tokens_before, computed_before)
            return (OpStatus.FAILED_PRECONDITION, f"request {client_request_id(key)!r} has no uncomputed tokens "
                    f"(num_tokens {req.num_tokens}, num_computed_tokens {start}); append tokens first", None, start,
                    0, None)
        quota = self.usage.quotas.get(tenant) if self.usage.quotas else None
        if quota is not None:
            needed = manager.num_blocks_needed(req, transferred + num_new, num_hit, hits, num_lookahead)
            used = self.usage.used(tenant)
            if used + needed > quota:
                self._undo(req, num_tokens_before, computed_before)
                return (OpStatus.RESOURCE_EXHAUSTED, f"tenant {tenant!r} block quota: {used} held + {needed} "
                        f"needed > quota {quota}", None, start, 0, None)
        new = manager.allocate_slots(req, transferred + num_new, num_hit, hits, num_lookahead,
                                     delay_cache_blocks or transferred > 0)
        if new is None:
            self._undo(req, num_tokens_before, computed_before)
            return self._no_space(pool, key, transferred + num_new, start)
        transfer = None
        if not running:
            req.num_computed_tokens = num_hit + transferred
            # Admission: the engine has no row yet, so it gets the whole table (hits included).
            new = KVCacheBlocks(manager.coordinator.get_blocks(key), new.replaced)
            if source is not None:
                transfer = self.transfers.open(session.session_id, source[0], source[1], pool, key, req, num_hit)
        if quota is not None:
            self.usage.update(tenant, pool, key)
        return OpStatus.OK, "", new, start, num_new, transfer

    @staticmethod
    def _no_space(pool: Pool, key: str, num_tokens: int, start: int):
        return (OpStatus.NO_SPACE, f"pool {pool.pool_id!r} has {pool.manager.block_pool.get_num_free_blocks()} free "
                f"blocks, not enough for {num_tokens} more tokens of {client_request_id(key)!r}", None, start, 0, None)

    @staticmethod
    def _append(req: Request, key: str, tokens, hashes, num_append: int) -> str | None:
        """Appends tokens (an int or uint32 array) or hashes; the reason when they do not fit."""
        if num_append and not req.has_token_ids:
            try:
                req.append_block_hashes(hashes or [], num_append)
            except ValueError as exc:
                return str(exc)
        elif tokens is not None and req.has_token_ids:
            req.append_output_token_ids(tokens)
        else:
            kind = "token ids" if req.has_token_ids else "block hashes"
            return f"request {client_request_id(key)!r} was added with {kind}: append {kind}"
        return None

    @staticmethod
    def _undo(req: Request, num_tokens: int, num_computed: int) -> None:
        if req.num_tokens != num_tokens:
            req.truncate(num_tokens)
        req.num_computed_tokens = num_computed

    def _fork(self, pool: Pool, session: Session, op: ForkOp) -> OpResult:
        tenant = session.tenant
        parent_key = request_key(tenant, op.parent_request_id)
        parent = pool.requests.get(parent_key)
        if parent is None:
            return self._missing(pool, parent_key, op.parent_request_id)
        child_key = request_key(tenant, op.child_request_id)
        if child_key in pool.requests:
            return OpResult(op.child_request_id, OpStatus.ALREADY_EXISTS,
                            f"request {op.child_request_id!r} already exists in pool {pool.pool_id!r}")
        if not pool.manager.coordinator.is_running(parent_key):
            return OpResult(op.child_request_id, OpStatus.FAILED_PRECONDITION,
                            f"parent {op.parent_request_id!r} holds no blocks yet: allocate it before forking")
        full = self._session_full(session, op.child_request_id)
        if full is not None:
            return full
        pending = self.transfers.pending(pool.pool_id, parent_key)
        if pending is not None:
            return OpResult(op.child_request_id, OpStatus.FAILED_PRECONDITION,
                            f"parent {op.parent_request_id!r} waits for transfer {pending}: commit it first")
        child = pool.manager.fork(parent, child_key)
        pool.requests[child_key] = child
        pool.owner[child_key] = session.session_id
        pool.tombstones.pop(child_key, None)
        session.own(pool.pool_id, child_key)
        self.usage.update(tenant, pool, child_key)
        return OpResult(op.child_request_id, new_block_ids=pool.manager.get_block_ids(child_key),
                        num_computed_tokens=child.num_computed_tokens, num_tokens=child.num_tokens)

    def _free_op(self, pool: Pool, session: Session, op: FreeOp) -> OpResult:
        key = request_key(session.tenant, op.request_id)
        if key not in pool.requests:
            result = self._missing(pool, key, op.request_id)
            pool.tombstones.pop(key, None)
            return result
        self._free(pool, session.tenant, key)
        return OpResult(op.request_id)

    def _free(self, pool: Pool, tenant: str, key: str) -> None:
        pending = self.transfers.pending(pool.pool_id, key)
        if pending is not None:  # its prefix will never be copied: drop the source pins
            self.transfers.close(self.transfers.transfers[pending], self.pools, commit=False)
        req = pool.requests.pop(key)
        pool.manager.free(req)
        owner = self.sessions.sessions.get(pool.owner.pop(key, ""))
        if owner is not None:
            owner.disown(pool.pool_id, key)
        self.usage.update(tenant, pool, key, removed=True)

    # ---- reads ---------------------------------------------------------------------------------
    def get_request(self, tenant: str, pool_id: str, request_id: str) -> tuple[Pool, Request]:
        pool = self.pool(pool_id)
        key = request_key(tenant, request_id)
        req = pool.requests.get(key)
        if req is None:
            reason = pool.tombstones.get(key)
            raise NotFound(reason or f"request {request_id!r} not found in pool {pool_id!r}")
        return pool, req

    def lookup(self, tenant: str, token_ids=None, block_hashes: Sequence[bytes] | None = None, num_tokens: int = 0,
               cache_salt: str | None = None, lora_name: str | None = None,
               pool_ids: Sequence[str] = ()) -> tuple[list[PoolHit], str]:
        """Per pool, the prefix tokens admission would reuse; and the pool a KV-aware router picks."""
        ns = namespace(tenant)
        if block_hashes is None:
            raw = hash_prompt(token_ids, self.hash_block_size, self.hash_seed, cache_salt, lora_name)
            num_tokens = len(token_ids)
        else:
            raw = list(block_hashes)
            num_tokens = num_tokens or len(raw) * self.hash_block_size
        hashes = [h + ns for h in raw] if ns else raw
        pools = [self.pool(p) for p in pool_ids] if pool_ids else list(self.pools.values())
        hits = [PoolHit(p.pool_id, p.cached_prefix_tokens(hashes, num_tokens),
                        p.manager.block_pool.get_num_free_blocks()) for p in pools]
        return hits, self._place(pools, hits, raw)

    @staticmethod
    def _place(pools: list[Pool], hits: list[PoolHit], raw_hashes: Sequence[bytes]) -> str:
        """Longest cached prefix; ties to the most free blocks that hold nothing cached (filling them
        evicts no one's prefix); remaining ties by the prompt's first block hash, so a prompt family
        keeps landing on the same pool instead of every cold prompt piling onto the first one."""
        if not hits:
            return ""
        best = max(h.num_cached_tokens for h in hits)
        tied = [(p, h) for p, h in zip(pools, hits) if h.num_cached_tokens == best]
        empty = {p.pool_id: max(0, h.num_free_blocks - len(p.manager.block_pool.cached_block_hash_to_block))
                 for p, h in tied}
        most = max(empty.values())
        tied = sorted(p.pool_id for p, _ in tied if empty[p.pool_id] == most)
        if len(tied) == 1 or not raw_hashes:
            return tied[0]
        return tied[int.from_bytes(raw_hashes[0][:8], "big") % len(tied)]

    def reset_prefix_cache(self, pool_ids: Sequence[str] = ()) -> tuple[list[str], list[str]]:
        pools = [self.pool(p) for p in pool_ids] if pool_ids else list(self.pools.values())
        done, refused = [], []
        for pool in pools:
            (done if pool.manager.reset_prefix_cache() else refused).append(pool.pool_id)
            self._drain(pool)
        return done, refused

    def invariant_violation(self, pool: Pool) -> str:
        try:
            check_invariants(pool.manager)
        except InvariantError as exc:
            return str(exc)
        live = {req.request_id for req in pool.requests.values()}
        live |= {t.holder for t in self.transfers.transfers.values() if t.src_pool == pool.pool_id}
        for manager in pool.manager.coordinator.managers:
            stray = set(manager.req_to_blocks) - live
            if stray:
                return f"blocks held for unknown requests {sorted(map(client_request_id, stray))[:5]}"
        return ""
