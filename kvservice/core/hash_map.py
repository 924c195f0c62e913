"""The prefix index: block-hash key -> cached block(s)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from kvservice.core.block import BlockHashWithGroupId, KVCacheBlock
from kvservice.hashing import BlockHash


class KeyListener(Protocol):
    def added(self, key: BlockHashWithGroupId) -> None: ...

    def removed(self, key: BlockHashWithGroupId) -> None: ...


class BlockHashToBlockMap:
    """key -> block, or {block_id: block} when several blocks carry one key (a bare block in the
    common case: no inner dict for the GC to track).

    There is no de-duplication on insert (two requests may cache identical blocks), because block
    tables are append-only: a request never swaps a block it already holds for an equal one.
    """

    __slots__ = ("_cache", "listener")

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # Told when a key comes in and when its last block goes (kvservice.allocator.global_index: one index
        # over every pool); None: nobody listens.
        self.listener: KeyListener | None = None

    def listen(self, listener: KeyListener | None) -> None:
        """`listener` is told every key present now, then every key that comes or goes; None: stops."""
        self.listener = listener
        if listener is not None:
            for key in self._cache:
                listener.added(key)

    def listened_keys(self) -> list[BlockHashWithGroupId]:
        return list(self._cache)

    def clear(self) -> None:
        if self.listener is not None:
            for key in self._cache:
                self.listener.removed(key)
        self._cache.clear()

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
            if self.listener is not None:
                self.listener.added(key)
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
                if self.listener is not None:
                    self.listener.removed(key)
                return entry
            self._cache[key] = entry
            return None
        block = entry.pop(block_id, None)
        if entry:
            self._cache[key] = entry
        elif self.listener is not None:
            self.listener.removed(key)
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
