"""In-process KV-cache allocator core (DESIGN §3): vLLM v1's names and semantics, no I/O.

Layering: KVCacheManager (policy) -> KVCacheCoordinator (agrees across groups) -> single-type
managers (per-group block tables) -> BlockPool (mechanism) -> FreeBlockQueue and the prefix index.
FastPath (a manager's `fast_path`) takes the single full-attention cases through the same hooks.
"""

from kvservice.core.block import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    make_block_hash_with_group_id,
)
from kvservice.core.block_pool import BlockHashToBlockMap, BlockPool
from kvservice.core.coordinator import KVCacheCoordinator
from kvservice.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvservice.core.fast_path import FastPath, PackedRows
from kvservice.core.free_queue import FreeBlockQueue
from kvservice.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvservice.core.managers import CoarseBlockHashes
from kvservice.core.request import Request
from kvservice.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvservice.core.stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared", "BlockHashToBlockMap", "BlockHashWithGroupId", "BlockPool", "BlockRemoved",
    "BlockStored", "ChunkedLocalAttentionSpec", "CoarseBlockHashes", "FastPath", "FreeBlockQueue", "FullAttentionSpec",
    "KVCacheBlock", "KVCacheBlocks", "KVCacheConfig", "KVCacheCoordinator", "KVCacheEvent", "KVCacheManager",
    "KVCacheSpec", "MambaSpec", "PackedRows", "PrefixCacheStats", "Request", "SlidingWindowSpec", "get_block_hash",
    "make_block_hash_with_group_id",
]
