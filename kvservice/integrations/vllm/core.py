"""A drop-in for vLLM 0.33.0's v1 KV-cache core, backed by kvservice.core (never by vLLM's classes).

Replace vLLM's names with these (`install()`; `REPLACES` lists where each lives in vLLM) and vLLM's
scheduler runs on kvservice's core: vLLM's `Request`, specs, `KVCacheConfig`, events and stats go in and come
out; the blocks, pool, managers and coordinators are kvservice.core's (specs.py converts vLLM's
specs, pool.py builds vLLM's events, managers.py and manager.py carry vLLM's signatures).
"""

from __future__ import annotations

import importlib
import sys

from kvservice.core import BlockHashToBlockMap, KVCacheBlock, KVCacheBlocks
from kvservice.core import FreeBlockQueue as FreeKVCacheBlockQueue
from kvservice.core.block import get_block_hash, get_group_id, make_block_hash_with_group_id
from kvservice.core.hash_views import CoarseBlockHashes as BlockHashListWithBlockSize
from kvservice.core.hash_views import resolve_block_hashes
from kvservice.integrations.vllm.hashing import (
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    get_request_block_hasher,
    hash_block_tokens,
)
from kvservice.integrations.vllm.manager import KVCacheManager
from kvservice.integrations.vllm.managers import (
    ChunkedLocalAttentionManager,
    CircularBufferManager,
    CrossAttentionManager,
    FullAttentionManager,
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    MambaManager,
    RSWAManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
    get_manager_for_kv_cache_spec,
)
from kvservice.integrations.vllm.pool import BlockPool


def _not_implemented(name: str) -> type:
    class NotImplementedManager:
        """vLLM's HiSparse host-offload tier (vllm.v1.hisparse) has no kvservice counterpart."""

        def __init__(self, *args, **kwargs) -> None:
            raise NotImplementedError(f"kvservice drop-in: {name} (the HiSparse host-offload tier) is not implemented")

    NotImplementedManager.__name__ = NotImplementedManager.__qualname__ = name
    return NotImplementedManager


HiSparseSourceManager = _not_implemented("HiSparseSourceManager")
HiSparseHotManager = _not_implemented("HiSparseHotManager")
HiSparseResidentManager = _not_implemented("HiSparseResidentManager")

# vLLM module -> the names of it this module replaces.
REPLACES: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.kv_cache_utils": (
        "KVCacheBlock", "FreeKVCacheBlockQueue", "get_request_block_hasher", "hash_block_tokens",
        "make_block_hash_with_group_id", "get_block_hash", "get_group_id", "BlockHashListWithBlockSize",
        "resolve_block_hashes", "generate_block_hash_extra_keys", "generate_lookahead_block_hash_extra_keys"),
    "vllm.v1.core.block_pool": ("BlockHashToBlockMap", "BlockPool"),
    "vllm.v1.core.kv_cache_manager": ("KVCacheBlocks", "KVCacheManager"),
    "vllm.v1.core.single_type_kv_cache_manager": (
        "FullAttentionManager", "RSWAManager", "SlidingWindowManager", "CircularBufferManager",
        "ChunkedLocalAttentionManager", "MambaManager", "CrossAttentionManager", "SinkFullAttentionManager",
        "HiSparseSourceManager", "HiSparseHotManager", "HiSparseResidentManager", "get_manager_for_kv_cache_spec"),
    "vllm.v1.core.kv_cache_coordinator": (
        "get_kv_cache_coordinator", "KVCacheCoordinatorNoPrefixCache", "UnitaryKVCacheCoordinator",
        "HybridKVCacheCoordinator"),
}

_replaced: dict[int, tuple[object, object]] = {}  # id(vLLM's object) -> (it, kept alive; ours)


def install() -> None:
    """Puts these names in vLLM's modules, and in every loaded vLLM module that imported vLLM's, so
    vLLM's scheduler (and anything else importing them afterwards) runs on kvservice's core. Call it
    before importing vLLM's scheduler; calling it again re-applies it (e.g. after a module reload)."""
    ours = globals()
    for module_name, names in REPLACES.items():
        module = importlib.import_module(module_name)
        for name in names:
            theirs = getattr(module, name, None)
            if theirs is not None and theirs is not ours[name]:
                _replaced[id(theirs)] = (theirs, ours[name])
            setattr(module, name, ours[name])
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("vllm.", "tests.")):
            continue
        namespace = getattr(module, "__dict__", {})
        for attr, value in list(namespace.items()):
            pair = _replaced.get(id(value))
            if pair is not None and pair[0] is value:
                namespace[attr] = pair[1]


__all__ = [
    "REPLACES", "install", "BlockHashListWithBlockSize", "BlockHashToBlockMap", "BlockPool",
    "ChunkedLocalAttentionManager",
    "CircularBufferManager", "CrossAttentionManager", "FreeKVCacheBlockQueue", "FullAttentionManager",
    "HiSparseHotManager", "HiSparseResidentManager", "HiSparseSourceManager", "HybridKVCacheCoordinator",
    "KVCacheBlock", "KVCacheBlocks", "KVCacheCoordinatorNoPrefixCache", "KVCacheManager", "MambaManager",
    "RSWAManager", "SinkFullAttentionManager", "SlidingWindowManager", "UnitaryKVCacheCoordinator",
    "generate_block_hash_extra_keys", "generate_lookahead_block_hash_extra_keys", "get_block_hash", "get_group_id",
    "get_kv_cache_coordinator", "get_manager_for_kv_cache_spec", "get_request_block_hasher", "hash_block_tokens",
    "make_block_hash_with_group_id", "resolve_block_hashes",
]
