"""In-process KV-cache allocator core: vLLM 0.33.0's names and semantics, no I/O.

Layering: KVCacheManager (policy) -> KVCacheCoordinator (agrees across groups) -> single-type
managers (per-group block tables) -> BlockPool (mechanism) -> FreeBlockQueue and the prefix index.
FastPath (a manager's `fast_path`) takes the single full-attention cases through the same hooks.
"""

from kvservice.core.block import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvservice.core.block_pool import BlockPool
from kvservice.core.connector_hooks import KVCacheBlockCopy
from kvservice.core.coordinator import (
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from kvservice.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvservice.core.fast_path import FastPath, PackedRows
from kvservice.core.free_queue import FreeBlockQueue
from kvservice.core.hash_map import BlockHashToBlockMap
from kvservice.core.hash_views import CoarseBlockHashes, resolve_block_hashes
from kvservice.core.hybrid_coordinator import HybridKVCacheCoordinator
from kvservice.core.kv_cache_blocks import KVCacheBlocks
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.managers import (
    ChunkedLocalAttentionManager,
    CircularBufferManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    RSWAManager,
    SingleTypeManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
)
from kvservice.core.request import Request
from kvservice.core.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvservice.core.stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared", "BlockHashToBlockMap", "BlockHashWithGroupId", "BlockPool", "BlockRemoved", "BlockStored",
    "ChunkedLocalAttentionManager", "ChunkedLocalAttentionSpec", "CircularBufferManager", "CircularBufferSpec",
    "CoarseBlockHashes", "CrossAttentionManager", "CrossAttentionSpec", "FastPath", "FreeBlockQueue",
    "FullAttentionManager", "FullAttentionSpec", "HybridKVCacheCoordinator", "KVCacheBlock", "KVCacheBlockCopy",
    "KVCacheBlocks", "KVCacheConfig", "KVCacheCoordinator", "KVCacheCoordinatorNoPrefixCache", "KVCacheEvent",
    "KVCacheManager", "KVCacheSpec", "MambaManager", "MambaSpec", "PackedRows", "PrefixCacheStats", "RSWAManager",
    "RSWASpec", "Request", "SingleTypeManager", "SinkFullAttentionManager", "SinkFullAttentionSpec",
    "SlidingWindowManager", "SlidingWindowSpec", "UnitaryKVCacheCoordinator", "get_block_hash", "get_group_id",
    "get_kv_cache_coordinator", "make_block_hash_with_group_id", "resolve_block_hashes",
]
