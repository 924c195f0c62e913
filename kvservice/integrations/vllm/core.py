"""A drop-in for vLLM 0.33.0's v1 KV-cache core, backed by kvservice.core (work in progress)."""

from __future__ import annotations


def _missing(name: str):
    class Missing:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"kvservice drop-in: {name} is not implemented yet")

    Missing.__name__ = Missing.__qualname__ = name
    return Missing


REPLACES: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.kv_cache_utils": ("KVCacheBlock", "FreeKVCacheBlockQueue", "get_request_block_hasher",
                                    "hash_block_tokens", "make_block_hash_with_group_id", "get_block_hash"),
    "vllm.v1.core.block_pool": ("BlockHashToBlockMap", "BlockPool"),
    "vllm.v1.core.kv_cache_manager": ("KVCacheBlocks", "KVCacheManager"),
    "vllm.v1.core.single_type_kv_cache_manager": (
        "FullAttentionManager", "RSWAManager", "SlidingWindowManager", "CircularBufferManager",
        "ChunkedLocalAttentionManager", "MambaManager", "CrossAttentionManager", "SinkFullAttentionManager",
        "HiSparseSourceManager", "HiSparseHotManager", "HiSparseResidentManager", "get_manager_for_kv_cache_spec"),
    "vllm.v1.core.kv_cache_coordinator": ("get_kv_cache_coordinator",),
}
for _names in REPLACES.values():
    for _name in _names:
        globals()[_name] = _missing(_name)
