"""Domain records for the allocator API: the ops of a Step and their results.

Clients build these; `kvservice.wire` turns them into protobuf and back; the allocator applies them
(inside a `kvservice.commands.Step`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import IntEnum

from kvservice.hashing import MultiModalItem


class OpStatus(IntEnum):
    """Per-op outcome (mirrors the proto enum)."""

    OK = 0
    NOT_FOUND = 1
    ALREADY_EXISTS = 2
    NO_SPACE = 3
    FAILED_PRECONDITION = 4
    RESOURCE_EXHAUSTED = 5
    EPOCH_CHANGED = 6


@dataclass(slots=True)
class AddRequestOp:
    """A waiting request, with token ids (the server hashes them) or client-computed block hashes."""

    request_id: str
    token_ids: array | list[int] | None = None
    block_hashes: list[bytes] | None = None
    num_tokens: int = 0  # with block_hashes
    cache_salt: str | None = None
    lora_name: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    num_prompt_tokens: int = 0  # with block_hashes: when num_tokens counts outputs too (0: num_tokens)


@dataclass(slots=True)
class ExternalSource:
    """A prefix pinned on another shard's pool (a PinOp there) that an admission copies in."""

    pin_id: str
    src_pool_id: str
    src_block_ids: list[int]
    num_tokens: int


@dataclass(slots=True)
class AllocateOp:
    """Schedule up to `num_new_tokens` of a request after its `num_computed_tokens`.

    On a pool with vLLM's semantics (PoolSpec.vllm) it is vLLM 0.33.0's `allocate_slots` (with
    `cache_tokens`, its `cache_blocks` first) with the fields after `external_source` (the proto says how)."""

    request_id: str
    num_computed_tokens: int = 0
    num_new_tokens: int = 0
    append_token_ids: array | list[int] | None = None
    append_block_hashes: list[bytes] | None = None
    num_append_tokens: int = 0
    num_lookahead_tokens: int = 0
    delay_cache_blocks: bool = False
    allow_transfer: bool = False
    external_source: ExternalSource | None = None
    # vLLM's semantics only:
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    waiting: bool = False
    lookup: bool = False
    num_new_computed_tokens: int = 0
    full_sequence_must_fit: bool = False
    reserved_blocks: int = 0
    has_scheduled_reqs: bool = False
    cache_tokens: int = 0
    num_external_computed_tokens: int = 0  # a KV connector's tokens (an admission)
    num_encoder_tokens: int = 0  # cross attention's (an encoder-decoder admission)
    max_cache_hit_length: int = 0  # the cap the admission's hit was looked up with (0: none)
    connector_lookup: bool = False  # the hit was looked up the KV connector's way (vLLM's hybrid divergent hits)
    shared_prefix_boundary: int | None = None  # an admission's (vLLM's request.shared_prefix_boundary); None: unchanged

    @property
    def vllm_fields(self) -> bool:
        """Whether any field only a vLLM-semantics pool takes is set."""
        return bool(self.num_output_placeholders or self.num_in_flight_tokens or self.waiting or self.lookup
                    or self.num_new_computed_tokens or self.full_sequence_must_fit or self.reserved_blocks
                    or self.has_scheduled_reqs or self.cache_tokens or self.num_external_computed_tokens
                    or self.num_encoder_tokens or self.max_cache_hit_length or self.connector_lookup
                    or self.shared_prefix_boundary is not None)


@dataclass(slots=True)
class PinOp:
    """Pins a prompt's cached prefix in this pool (the source of a cross-shard transfer) until UnpinOp or the
    session's end. Its result: the pinned block ids and the prefix tokens they hold."""

    pin_id: str
    token_ids: array | list[int] | None = None
    block_hashes: list[bytes] | None = None
    num_tokens: int = 0  # with block_hashes
    cache_salt: str | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class UnpinOp:
    pin_id: str


@dataclass(slots=True)
class ForkOp:
    parent_request_id: str
    child_request_id: str


@dataclass(slots=True)
class FreeOp:
    """Frees a request's blocks, tail first; `popped` (vLLM pools): in the order of vLLM's deferred free
    (pop_blocks_for_free, then free_blocks(reversed(...))): all groups' blocks in one list, tail first."""

    request_id: str
    popped: bool = False


@dataclass(slots=True)
class EvictBlocksOp:
    """vLLM's evict_blocks (a KV connector's failed loads): the blocks leave the prefix cache."""

    block_ids: list[int]


@dataclass(slots=True)
class RemoveSkippedBlocksOp:
    """vLLM's remove_skipped_blocks outside an allocation (a KV connector's finished request): frees the request's
    blocks no token after its first `processed_computed_tokens` reads (a sliding window's, below the window)."""

    request_id: str
    processed_computed_tokens: int


@dataclass(slots=True)
class NewStepOp:
    """vLLM's new_step_starts (a vLLM pool's scheduler step starts here): Mamba states cached before it may hit."""


@dataclass(slots=True)
class TakeBlockCopiesOp:
    """vLLM 0.33's take_kv_cache_block_copies (vLLM pools): the copies the scheduler took, (src, dst) pairs
    flattened. The pool's own pending copies (each must be among them) drain, both ends held until
    FreeHeldBlocksOp; any other pair must name held blocks. FAILED_PRECONDITION, nothing changed, else."""

    block_ids: list[int]


@dataclass(slots=True)
class GetNewBlocksOp:
    """vLLM's block_pool.get_new_blocks outside any request (vLLM pools): `num_blocks` blocks, held until
    FreeHeldBlocksOp; answered as new_block_ids (ids,), or NO_SPACE with nothing taken."""

    num_blocks: int


@dataclass(slots=True)
class TouchBlocksOp:
    """vLLM's block_pool.touch outside any request (vLLM pools; a KV connector pinning blocks): one held reference
    per id until FreeHeldBlocksOp (a free block leaves the free queue, still cached)."""

    block_ids: list[int]


@dataclass(slots=True)
class FreeHeldBlocksOp:
    """vLLM's block_pool.free_blocks of held blocks (copy retentions, GetNewBlocksOp, TouchBlocksOp), in this order;
    FAILED_PRECONDITION, nothing returned, for an id named more often than it is held."""

    block_ids: list[int]


HELD_BLOCK_OPS = (TakeBlockCopiesOp, GetNewBlocksOp, TouchBlocksOp, FreeHeldBlocksOp)


@dataclass(slots=True)
class ResetPrefixCacheOp:
    """Drops the pool's cached prefixes (vLLM's reset_prefix_cache): FAILED_PRECONDITION while a block is in use."""


@dataclass(slots=True)
class DecodeBatchOp:
    """Running requests advancing together, packed: entry i is
    AllocateOp(request_ids[i], num_computed_tokens[i], num_new_tokens, [append_token_ids[i]], num_lookahead_tokens)."""

    request_ids: list[str]
    num_computed_tokens: array | list[int]
    append_token_ids: array | list[int] | None = None
    num_new_tokens: int = 1
    num_lookahead_tokens: int = 0


# An AllocateBatchOp row: these AllocateOp fields as uint32s, in this order.
ALLOCATE_ROW = ("num_computed_tokens", "num_new_tokens", "num_lookahead_tokens", "num_append_tokens",
                "num_append_hashes", "num_output_placeholders", "num_in_flight_tokens", "cache_tokens",
                "reserved_blocks", "flags")
ROW_WIDTH = len(ALLOCATE_ROW)
# The row's flags.
WAITING, DELAY_CACHE_BLOCKS, FULL_SEQUENCE_MUST_FIT, HAS_SCHEDULED_REQS = 1, 2, 4, 8
ROW_FLAGS = 15


@dataclass(slots=True)
class AllocateBatchOp:
    """AllocateOps of a pool with vLLM's semantics, packed (a vLLM scheduler's running requests of one step):
    row i is request_ids[i]'s AllocateOp (lookup off, no token ids), its fields the ROW_WIDTH uint32s
    rows[ROW_WIDTH * i:] in ALLOCATE_ROW's order; its appended hashes are the next num_append_hashes of
    `append_block_hashes`. Rows apply in order, each exactly as its AllocateOp; the result is packed."""

    request_ids: list[str]
    rows: array  # uint32
    append_block_hashes: list[bytes] = field(default_factory=list)

    def ops(self) -> list[AllocateOp]:
        """The AllocateOps the rows stand for."""
        out = []
        hashes, h = self.append_block_hashes, 0
        it = iter(self.rows)
        for request_id, row in zip(self.request_ids, zip(*[it] * ROW_WIDTH)):
            computed, new, lookahead, num_append, num_hashes, placeholders, in_flight, cache, reserved, flags = row
            appended = None
            if num_hashes or num_append:
                appended, h = hashes[h:h + num_hashes], h + num_hashes
            out.append(AllocateOp(request_id, computed, new, None, appended, num_append, lookahead,
                                  bool(flags & DELAY_CACHE_BLOCKS), False, None, placeholders, in_flight,
                                  bool(flags & WAITING), False, 0, bool(flags & FULL_SEQUENCE_MUST_FIT), reserved,
                                  bool(flags & HAS_SCHEDULED_REQS), cache))
        return out

    @classmethod
    def of(cls, ops: list[AllocateOp]) -> AllocateBatchOp:
        """Packs AllocateOps that a row can carry (lookup off, no token ids, no transfer)."""
        rows, hashes = array("I"), []
        for op in ops:
            if (op.lookup or op.num_new_computed_tokens or op.append_token_ids is not None or op.allow_transfer
                    or op.external_source is not None):
                raise ValueError(f"AllocateOp for {op.request_id!r} has a lookup (a hit), token ids or a transfer: "
                                 f"an AllocateBatchOp row cannot carry it")
            appended = op.append_block_hashes or []
            hashes.extend(appended)
            rows.extend((op.num_computed_tokens, op.num_new_tokens, op.num_lookahead_tokens, op.num_append_tokens,
                         len(appended), op.num_output_placeholders, op.num_in_flight_tokens, op.cache_tokens,
                         op.reserved_blocks, row_flags(op.waiting, op.delay_cache_blocks, op.full_sequence_must_fit,
                                                       op.has_scheduled_reqs)))
        return cls([op.request_id for op in ops], rows, hashes)


def row_flags(waiting: bool, delay_cache_blocks: bool, full_sequence_must_fit: bool,
              has_scheduled_reqs: bool) -> int:
    return (WAITING * waiting | DELAY_CACHE_BLOCKS * delay_cache_blocks
            | FULL_SEQUENCE_MUST_FIT * full_sequence_must_fit | HAS_SCHEDULED_REQS * has_scheduled_reqs)


@dataclass(slots=True)
class AdmitBatchOp:
    """Waiting requests added and scheduled together, packed: entry i is
    AddRequestOp(request_ids[i], prompts[i], cache_salt=cache_salts[i], lora_name=lora_names[i]) and, when
    that added the request, AllocateOp(request_ids[i], num_new_tokens=num_new_tokens[i], num_lookahead_tokens).
    None for num_new_tokens: each whole prompt; for cache_salts / lora_names: none."""

    request_ids: list[str]
    prompts: list[array | list[int]]
    num_new_tokens: list[int] | None = None
    num_lookahead_tokens: int = 0
    cache_salts: list[str | None] | None = None
    lora_names: list[str | None] | None = None


Op = (AddRequestOp | AllocateOp | ForkOp | FreeOp | DecodeBatchOp | AdmitBatchOp | AllocateBatchOp | PinOp | UnpinOp
      | ResetPrefixCacheOp | EvictBlocksOp | RemoveSkippedBlocksOp | NewStepOp | TakeBlockCopiesOp | GetNewBlocksOp
      | TouchBlocksOp | FreeHeldBlocksOp)


@dataclass(slots=True)
class TransferOrder:
    """Copy `src_block_ids` of pool `src_pool_id` into `dst_block_ids` of this request's pool, then
    `CommitTransfer` (the destination blocks become cached, the source pins drop) or abort it."""

    transfer_id: str
    src_pool_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    num_tokens: int


@dataclass(slots=True)
class PackedResult:
    """Packed per-request outcomes of a DecodeBatchOp, an AllocateBatchOp or an AdmitBatchOp (whose new blocks
    are each admitted request's whole table)."""

    statuses: bytes
    num_new_blocks: array  # uint32 per (request, group), row-major
    new_block_ids: array  # uint32, concatenated
    num_computed_tokens: array
    num_scheduled_tokens: array
    failures: list[OpResult]
    num_groups: int
    replaced: list[tuple[int, int, int, int]] = field(default_factory=list)  # (request index, group, index, id)

    def __len__(self) -> int:
        return len(self.statuses)

    def status(self, i: int) -> OpStatus:
        return OpStatus(self.statuses[i])

    def block_ids(self) -> list[tuple[list[int], ...]]:
        """New block ids per request, one list per group."""
        out = []
        pos = 0
        counts = self.num_new_blocks
        ids = self.new_block_ids
        g = self.num_groups
        for i in range(len(self.statuses)):
            groups = []
            for j in range(g):
                n = counts[i * g + j]
                groups.append(ids[pos:pos + n].tolist())
                pos += n
            out.append(tuple(groups))
        return out


DecodeBatchResult = PackedResult  # the name before admissions were packed too


@dataclass(slots=True)
class OpResult:
    request_id: str
    status: OpStatus = OpStatus.OK
    message: str = ""
    new_block_ids: tuple[list[int], ...] = ()
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_tokens: int = 0
    transfer: TransferOrder | None = None
    batch: PackedResult | None = None
    replaced: list[tuple[int, int, int]] = field(default_factory=list)  # (group, index, new block id)

    @property
    def ok(self) -> bool:
        return self.status == OpStatus.OK


@dataclass(slots=True)
class StepResult:
    sequence: int
    results: list[OpResult] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_free_blocks: int = 0  # the pool's, after the step

    def __getitem__(self, i: int) -> OpResult:
        return self.results[i]
