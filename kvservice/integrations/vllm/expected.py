"""What a RemoteKVCacheManager's replica expects of the pool for one Step, and the check of the pool's reply
against it: the same outcome per op and row, the same block ids, the same free-block count."""

from __future__ import annotations

import threading
from array import array
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvservice.ops import AllocateBatchOp, Op, OpResult, OpStatus, StepResult

RESTART = ("Another client changed this pool, or the allocator lost state: restart the engine (a new pool "
           "epoch)")


class PoolDiverged(RuntimeError):
    """The allocator's pool answered differently from the scheduler's replica of it."""


@dataclass(slots=True)
class Expected:
    """What the replica answered for one op: OK with these block ids (None: unchecked), or NO_SPACE."""

    status: OpStatus = OpStatus.OK
    block_ids: tuple[list[int], ...] | None = None


@dataclass(slots=True)
class Rows:
    """An AllocateBatchOp being recorded, with the replica's answers: the new block ids of the rows that took
    blocks, and the rows it refused (NO_SPACE); every other row is OK with no new blocks."""

    op: AllocateBatchOp = field(default_factory=lambda: AllocateBatchOp([], array("I"), []))
    blocks: dict[int, tuple[list[int], ...]] = field(default_factory=dict)
    no_space: set[int] = field(default_factory=set)

    def answer(self, row: int, new) -> None:
        """The replica's allocate_slots result for `row` (None: refused)."""
        if new is None:
            self.no_space.add(row)
        elif any(new.blocks):
            self.blocks[row] = new.get_block_ids()


@dataclass(slots=True)
class InFlight:
    """A sent Step: its reply (a future) and what the replica expects of it."""

    future: Future
    ops: list[Op]
    expected: list[Expected | Rows]
    num_free_blocks: int
    started: threading.Event = field(default_factory=threading.Event)


def check_step(pool_id: str, sent: InFlight, result: StepResult, num_groups: int) -> None:
    """The pool's reply to `sent` against the replica's answers (PoolDiverged at the first difference)."""
    ops = sent.ops
    if len(result.results) != len(ops):
        raise PoolDiverged(f"pool {pool_id!r} answered {len(result.results)} results for {len(ops)} ops")
    for i, (op, want, got) in enumerate(zip(ops, sent.expected, result.results)):
        if isinstance(want, Rows):
            _check_rows(pool_id, i, want, got, num_groups)
        elif got.status != want.status or (want.block_ids is not None and _ids(got.new_block_ids, num_groups)
                                           != _ids(want.block_ids, num_groups)):
            what = f"{type(op).__name__} for {getattr(op, 'request_id', '')!r}"
            raise PoolDiverged(
                f"pool {pool_id!r} answered op {i} ({what}) with {got.status.name} {got.new_block_ids} "
                f"{got.message!r}; the scheduler's replica with {want.status.name} {want.block_ids}. {RESTART}")
    if result.num_free_blocks != sent.num_free_blocks:
        raise PoolDiverged(f"pool {pool_id!r} has {result.num_free_blocks} free blocks after the step, the "
                           f"scheduler's replica {sent.num_free_blocks}; restart the engine (a new pool epoch)")


def _check_rows(pool_id: str, index: int, want: Rows, got: OpResult, num_groups: int) -> None:
    """An AllocateBatchOp's packed outcome against the replica's: compared whole (in C), row by row only to
    name the first difference."""
    batch, request_ids = got.batch, want.op.request_ids
    n = len(request_ids)
    statuses = bytearray(n)
    for row in want.no_space:
        statuses[row] = OpStatus.NO_SPACE
    counts = array("I", bytes(4 * n * num_groups))
    ids = array("I")
    for row in sorted(want.blocks):
        for g, table in enumerate(want.blocks[row]):
            counts[row * num_groups + g] = len(table)
            ids.extend(table)
    if (got.status == OpStatus.OK and batch is not None and batch.statuses == statuses
            and batch.num_new_blocks == counts and batch.new_block_ids == ids):
        return
    if got.status != OpStatus.OK or batch is None or len(batch.statuses) != n:
        raise PoolDiverged(f"pool {pool_id!r} answered op {index} (AllocateBatchOp of {n} rows) with "
                           f"{got.status.name} {got.message!r} and {len(batch.statuses) if batch else 'no'} rows")
    tables, failures = batch.block_ids(), iter(batch.failures)
    for row, rid in enumerate(request_ids):
        status, want_status = batch.status(row), OpStatus(statuses[row])
        failure = next(failures, None) if status else None
        message = failure.message if failure is not None else ""
        blocks = want.blocks.get(row)
        if status != want_status or _ids(tables[row], num_groups) != _ids(blocks, num_groups):
            raise PoolDiverged(f"pool {pool_id!r} answered op {index} row {row} (allocation for {rid!r}) with "
                               f"{status.name} {tables[row]} {message!r}; the scheduler's replica with "
                               f"{want_status.name} {blocks}. {RESTART}")
    raise PoolDiverged(f"pool {pool_id!r} answered op {index} (AllocateBatchOp) differently from the replica")


def _ids(groups, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """Block ids per group; no groups at all means every group empty (the wire leaves them out)."""
    return tuple(tuple(g) for g in groups) if groups else ((),) * num_groups
