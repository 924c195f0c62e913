"""Server side: the Step ops only a pool with vLLM's semantics takes, each naming its field when refused.

vLLM's `evict_blocks` and `remove_skipped_blocks` called outside an allocation, and the blocks a vLLM
scheduler holds outside its requests: copy retentions (`take_block_copies`), blocks taken straight from the
pool (`get_new_blocks`), touched ones (`touch_blocks`) and their release (`free_held_blocks`)."""

from __future__ import annotations

from kvservice._proto import allocator_pb2 as pb
from kvservice.commands import PoolSpec
from kvservice.errors import InvalidArgument
from kvservice.ops import (
    EvictBlocksOp,
    FreeHeldBlocksOp,
    GetNewBlocksOp,
    RemoveSkippedBlocksOp,
    TakeBlockCopiesOp,
    TouchBlocksOp,
)
from kvservice.wire.fields import check_count, check_id


def _vllm_only(field: str, vllm: bool, what: str) -> None:
    if not vllm:
        raise InvalidArgument(field, "...", f"only a pool registered with vllm options takes it ({what})")


def _block_ids(field: str, block_ids, num_blocks: int, max_count: int, pairs: bool = False) -> list[int]:
    """Block ids of the pool, at most `max_count` of them (`pairs`: an even count); the null block and ids
    past the pool refused."""
    ids = list(block_ids)
    check_count(field, len(ids), max_count)
    if pairs and len(ids) % 2:
        raise InvalidArgument(field, len(ids), "must be (src, dst) pairs: an even count")
    bad = next((b for b in ids if not 0 < b < num_blocks), None)
    if bad is not None:
        raise InvalidArgument(field, bad, f"must be in [1, {num_blocks - 1}] (block 0 is the null block)")
    return ids


def decode_evict(e: pb.EvictBlocksOp, spec: PoolSpec, vllm: bool, field: str) -> EvictBlocksOp:
    """vLLM's evict_blocks (a connector's failed loads), and a store's drop of pages whose files failed
    verification: block ids of the pool, any pool."""
    num_blocks = spec.config.num_blocks
    return EvictBlocksOp(_block_ids(f"{field}.block_ids", e.block_ids, num_blocks, num_blocks))


def decode_held(op: pb.Op, kind: str, spec: PoolSpec, vllm: bool,
                field: str) -> TakeBlockCopiesOp | GetNewBlocksOp | TouchBlocksOp | FreeHeldBlocksOp:
    """The ops of blocks a vLLM scheduler holds outside requests: copy retentions, direct takes and touches."""
    _vllm_only(field, vllm, "blocks a vLLM scheduler holds outside its requests")
    num_blocks = spec.config.num_blocks
    if kind == "get_new_blocks":
        return GetNewBlocksOp(check_count(f"{field}.num_blocks", op.get_new_blocks.num_blocks, num_blocks))
    ids = _block_ids(f"{field}.block_ids", getattr(op, kind).block_ids, num_blocks, 2 * num_blocks,
                     pairs=kind == "take_block_copies")
    if kind == "take_block_copies":
        return TakeBlockCopiesOp(ids)
    return TouchBlocksOp(ids) if kind == "touch_blocks" else FreeHeldBlocksOp(ids)


def decode_remove_skipped(r: pb.RemoveSkippedBlocksOp, spec: PoolSpec, vllm: bool,
                          field: str) -> RemoveSkippedBlocksOp:
    """vLLM's remove_skipped_blocks outside an allocation: a request id and a processed-token count."""
    _vllm_only(field, vllm, "vLLM's remove_skipped_blocks")
    request_id = check_id(f"{field}.request_id", r.request_id)
    num = check_count(f"{field}.processed_computed_tokens", r.processed_computed_tokens, spec.max_model_len)
    return RemoveSkippedBlocksOp(request_id, num)
