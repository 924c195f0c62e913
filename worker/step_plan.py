"""One scheduler step as a record: what the engine asks the allocator for, and the reply read back per part.

    Engine._plan -> StepPlan -> ops() -> one Step RPC -> StepPlan.replies(result) -> StepReplies
    The ops go in a fixed order (forks, frees, prefill chunks, one DecodeBatchOp, one AdmitBatchOp, then
    admission pairs that may adopt another pool's prefix), so each reply is found by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    TransferOrder,
)
from worker.request import EngineRequest


@dataclass(slots=True)
class StepPlan:
    forks: list[tuple[EngineRequest, EngineRequest]] = field(default_factory=list)  # (parent, child)
    frees: list[EngineRequest] = field(default_factory=list)
    chunks: list[tuple[EngineRequest, int]] = field(default_factory=list)  # (running request, token budget)
    decodes: list[EngineRequest] = field(default_factory=list)  # running requests computing their last token
    admissions: list[tuple[EngineRequest, int]] = field(default_factory=list)  # (waiting request, budget), packed
    transfer_admissions: list[tuple[EngineRequest, int]] = field(default_factory=list)  # may adopt a prefix

    def ops(self) -> list[Op]:
        # Forks first (a parent may finish in the same step), then frees, then work.
        ops: list[Op] = [ForkOp(parent.request_id, child.request_id) for parent, child in self.forks]
        ops += [FreeOp(r.request_id) for r in self.frees]
        ops += [AllocateOp(r.request_id, num_computed_tokens=r.num_computed, num_new_tokens=n) for r, n in self.chunks]
        if self.decodes:
            ops.append(DecodeBatchOp([r.request_id for r in self.decodes], [r.num_computed for r in self.decodes],
                                     [r.tokens[-1] for r in self.decodes]))
        if self.admissions:
            ops.append(AdmitBatchOp([r.request_id for r, _ in self.admissions], [r.tokens for r, _ in self.admissions],
                                    [n for _, n in self.admissions]))
        # AdmitBatchOp carries no allow_transfer: an admission that may adopt a prefix is a pair.
        for r, n in self.transfer_admissions:
            ops += [AddRequestOp(r.request_id, token_ids=r.tokens),
                    AllocateOp(r.request_id, num_new_tokens=n, allow_transfer=True)]
        return ops

    def replies(self, result: StepResult) -> StepReplies:
        """The reply to each part of the plan (`result.results` is in `ops()` order)."""
        results = result.results
        pos = len(self.forks) + len(self.frees)
        forks = results[:len(self.forks)]
        chunks = results[pos:pos + len(self.chunks)]
        pos += len(self.chunks)
        decode = admit = None
        if self.decodes:
            decode, pos = results[pos].batch, pos + 1
        if self.admissions:
            admit, pos = results[pos].batch, pos + 1
        pairs = results[pos:]
        for r, add in zip((r for r, _ in self.transfer_admissions), pairs[0::2]):
            if add.status != OpStatus.OK:
                raise RuntimeError(f"adding {r.request_id} failed: {add.status.name} {add.message}")
        return StepReplies(forks, chunks, decode, admit, pairs[1::2], list(result.copies))


@dataclass(slots=True)
class StepReplies:
    forks: list[OpResult]
    chunks: list[OpResult]
    decode: DecodeBatchResult | None
    admit: DecodeBatchResult | None
    transfer_admissions: list[OpResult]  # the AllocateOp of each pair
    copies: list[tuple[int, int]]  # copy-on-write (src, dst) block ids, executed before this step's writes


@dataclass(slots=True)
class Growth:
    """One entry's allocation outcome, from a packed batch or an `OpResult` alike."""

    status: OpStatus
    message: str
    new_blocks: list[list[int]]  # per group: appended to the row (an admission: the whole row)
    replaced: list[tuple[int, int, int]]  # (group, index, block id) swapped by copy-on-write
    start: int  # the first token scheduled (an admission: its cached prefix)
    count: int  # tokens scheduled
    transfer: TransferOrder | None = None


def growth(r: OpResult, num_groups: int) -> Growth:
    # A refused op, or one that scheduled nothing, may carry fewer groups than the pool has.
    new = [list(ids) for ids in r.new_block_ids] + [[] for _ in range(num_groups - len(r.new_block_ids))]
    return Growth(r.status, r.message, new, list(r.replaced), r.num_computed_tokens, r.num_scheduled_tokens,
                  r.transfer)


def batch_growths(batch: DecodeBatchResult) -> list[Growth]:
    """Per-entry outcomes of a packed DecodeBatchOp / AdmitBatchOp reply."""
    replaced: dict[int, list[tuple[int, int, int]]] = {}
    for i, group, index, block_id in batch.replaced:
        replaced.setdefault(i, []).append((group, index, block_id))
    failures = iter(batch.failures)  # one per entry that failed, in entry order
    out = []
    for i, groups in enumerate(batch.block_ids()):
        status = batch.status(i)
        message = next(failures).message if status != OpStatus.OK else ""
        out.append(Growth(status, message, [list(ids) for ids in groups], replaced.get(i, []),
                          batch.num_computed_tokens[i], batch.num_scheduled_tokens[i]))
    return out
