"""The prefix index: block-hash key -> cached block(s)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvservice.core.block import BlockHashWithGroupId, KVCacheBlock
from kvservice.hashing import BlockHash


class BlockHashToBlockMap:
    """key -> block, or {block_id: block} when several blocks carry one key (a bare block in the
    common case: no inner dict for the GC to track).

    There is no de-duplication on insert (two requests may cache identical blocks), because block
    tables are append-only: a request never swaps a block it already holds for an equal one.
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        if isinstance(entry, dict):
            return next(iter(entry.values()))
        raise AssertionError(f"Invalid KV cache block type {type(entry)}")

    def get_cached_prefix(self, block_hashes: Sequence[BlockHash], group_suffix: bytes,
                          max_blocks: int) -> list[KVCacheBlock]:
        """The blocks cached under block_hashes[0], [1], ... (the first block of each), up to the first
        miss or `max_blocks`: one group's prefix lookup in one loop (the fast path's admission)."""
        get = self._cache.get
        out: list[KVCacheBlock] = []
        append = out.append
        for i in range(max_blocks):
            entry = get(block_hashes[i] + group_suffix)
            if entry is None:
                break
            append(entry if type(entry) is KVCacheBlock else next(iter(entry.values())))
        return out

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        entry = self._cache.get(key)
        if entry is None:
            return False
        if type(entry) is KVCacheBlock:
            return entry.block_id == block_id
        return block_id in entry

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif type(entry) is KVCacheBlock:
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Removes the entry of `block_id` under `key` only (other blocks with that key stay)."""
        entry = self._cache.pop(key, None)
        if entry is None:
            return None
        if type(entry) is KVCacheBlock:
            if entry.block_id == block_id:
                return entry
            self._cache[key] = entry
            return None
        block = entry.pop(block_id, None)
        if entry:
            self._cache[key] = entry
        return block

    def items(self) -> Iterable[tuple[BlockHashWithGroupId, KVCacheBlock]]:
        for key, entry in self._cache.items():
            if type(entry) is KVCacheBlock:
                yield key, entry
            else:
                for block in entry.values():
                    yield key, block

    def __len__(self) -> int:
        return len(self._cache)
