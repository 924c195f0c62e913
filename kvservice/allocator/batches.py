"""Packed ops: a DecodeBatchOp (running requests advancing together) and an AdmitBatchOp (waiting
requests added and scheduled together). Entry i of either is exactly the single ops it stands for,
taken through the same steps (`RequestBook`, `Scheduler`); outcomes come back packed (`PackedResult`).
Runs of common decode entries go through the core's batch fast path; the scheduler decides the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from kvservice.allocator.keys import SEP, namespace
from kvservice.allocator.pools import Pool
from kvservice.allocator.requests import RequestBook
from kvservice.allocator.schedule import Allocation, Scheduled, Scheduler
from kvservice.allocator.sessions import Session
from kvservice.allocator.state import AllocatorState
from kvservice.core import KVCacheBlocks, PackedRows, Request
from kvservice.ops import AdmitBatchOp, DecodeBatchOp, OpResult, OpStatus, PackedResult

_BLOCK_ID = attrgetter("block_id")


def pack(out: PackedRows, replaced: list, i: int, new: KVCacheBlocks, num_groups: int) -> None:
    """Entry i's blocks into a packed result: a count and the ids per group, its swaps."""
    groups = new.blocks
    for g in range(num_groups):
        table = groups[g] if g < len(groups) else ()  # nothing scheduled: one empty group
        out.num_new_blocks.append(len(table))
        out.new_block_ids.extend(map(_BLOCK_ID, table))
    for g, index, block_id in new.replaced:
        replaced.append((i, g, index, block_id))


class Batches:
    def __init__(self, state: AllocatorState, book: RequestBook, scheduler: Scheduler) -> None:
        self.state = state
        self.book = book
        self.scheduler = scheduler

    def decode(self, pool: Pool, session: Session, op: DecodeBatchOp) -> OpResult:
        """Entry i is AllocateOp(request_ids[i], num_computed_tokens[i], num_new_tokens,
        [append_token_ids[i]], num_lookahead_tokens)."""
        tenant = session.tenant
        n = len(op.request_ids)
        statuses = bytearray(n)
        out = PackedRows()
        failures: list[OpResult] = []
        replaced: list[tuple[int, int, int, int]] = []
        num_groups = len(pool.spec.config.groups)
        tokens, computed = op.append_token_ids, op.num_computed_tokens
        budget, lookahead = op.num_new_tokens or 1, op.num_lookahead_tokens
        keys = [f"{tenant}{SEP}{r}" for r in op.request_ids] if tenant else op.request_ids
        reqs = list(map(pool.requests.get, keys))
        fast, fast_reqs = self._batch_path(pool, tenant, keys, reqs)
        i = 0
        while i < n:
            if fast is not None:
                i = fast.allocate_running_batch(fast_reqs, computed, tokens, budget, lookahead, i, out)
                if i == n:
                    break
            request_id, key, req = op.request_ids[i], keys[i], reqs[i]
            if req is None:
                failure: OpResult | None = self.book.missing(pool, key, request_id)
                s = Scheduled(failure.status)
            else:
                a = Allocation(computed[i], budget, None if tokens is None else tokens[i], None, 0, lookahead)
                s = self.scheduler.schedule(pool, session, key, req, a)
                failure = None if s.blocks is not None else OpResult(request_id, s.status, s.message, (), s.start,
                                                                     s.num_scheduled, req.num_tokens)
            if failure is not None:
                statuses[i] = failure.status
                failures.append(failure)
                out.num_new_blocks.extend([0] * num_groups)
            else:
                pack(out, replaced, i, s.blocks, num_groups)
            out.num_computed.append(s.start)
            out.num_scheduled.append(s.num_scheduled)
            i += 1
        return self._result(statuses, out, failures, num_groups, replaced)

    def admit(self, pool: Pool, session: Session, op: AdmitBatchOp) -> OpResult:
        """Entry i is AddRequestOp(request_ids[i], prompts[i], ...) and, when that added the request,
        AllocateOp(request_ids[i], num_new_tokens=...); each admitted request's whole table comes back."""
        tenant = session.tenant
        ns = namespace(tenant)
        n = len(op.request_ids)
        statuses = bytearray(n)
        out = PackedRows()
        computed, scheduled = out.num_computed, out.num_scheduled
        failures: list[OpResult] = []
        replaced: list[tuple[int, int, int, int]] = []
        num_groups = len(pool.spec.config.groups)
        budgets, salts, loras, lookahead = op.num_new_tokens, op.cache_salts, op.lora_names, op.num_lookahead_tokens
        for i, request_id in enumerate(op.request_ids):
            key = f"{tenant}{SEP}{request_id}" if tenant else request_id
            failure = self.book.refuse_add(pool, session, key, request_id)
            if failure is None:
                prompt = op.prompts[i]
                req = pool.request_from_tokens(key, prompt, salts[i] if salts else None, loras[i] if loras else None,
                                               namespace=ns)
                self.book.track(pool, session, key, req)
                a = Allocation(0, len(prompt) if budgets is None else budgets[i], None, None, 0, lookahead)
                s = self.scheduler.schedule(pool, session, key, req, a)
                if s.blocks is None:
                    failure = OpResult(request_id, s.status, s.message, (), s.start, s.num_scheduled, req.num_tokens)
            if failure is not None:
                statuses[i] = failure.status
                failures.append(failure)
                out.num_new_blocks.extend([0] * num_groups)
                computed.append(failure.num_computed_tokens)
                scheduled.append(failure.num_scheduled_tokens)
                continue
            pack(out, replaced, i, s.blocks, num_groups)
            computed.append(s.start)
            scheduled.append(s.num_scheduled)
        return self._result(statuses, out, failures, num_groups, replaced)

    @staticmethod
    def _result(statuses: bytearray, out: PackedRows, failures: list[OpResult], num_groups: int,
                replaced: list) -> OpResult:
        packed = PackedResult(bytes(statuses), out.num_new_blocks, out.new_block_ids, out.num_computed,
                              out.num_scheduled, failures, num_groups, replaced)
        return OpResult("", OpStatus.OK, "", (), 0, 0, 0, None, packed)

    def _batch_path(self, pool: Pool, tenant: str, keys: Sequence[str], reqs: list[Request | None]):
        """The core's batch decode path and the requests it may take (None: the scheduler decides),
        unless something of the service's own is in the way: a tenant quota needs per-allocation
        accounting, a request waiting for a transfer must not run."""
        fast = pool.manager.fast_path
        if fast is None or (self.state.usage.quotas and tenant in self.state.usage.quotas):
            return None, reqs
        pending = self.state.transfers.by_dst
        if pending:
            reqs = [None if (pool.pool_id, key) in pending else req for key, req in zip(keys, reqs)]
        return fast, reqs
