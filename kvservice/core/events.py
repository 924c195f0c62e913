"""KV-cache events, drained by `take_events()` (vLLM's BlockStored / BlockRemoved / AllBlocksCleared)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from kvservice.hashing import BlockHash


@dataclass(slots=True)
class BlockStored:
    """Blocks that became cached: one event per `cache_full_blocks` call."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: array  # uint32 (vLLM: a list); empty when the request was added by hashes (token ids unknown)
    block_size: int
    group_idx: int
    lora_name: str | None = None
    medium: str = "GPU"
    block_ids: list[int] = field(default_factory=list)
    lora_id: int | None = None
    session_id: str | None = None
    # The group's spec, set by KVCacheManager.take_events (vLLM's names).
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """One evicted hash."""

    block_hashes: list[BlockHash]
    group_idx: int
    medium: str = "GPU"


@dataclass(slots=True)
class AllBlocksCleared:
    medium: str = "GPU"


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
