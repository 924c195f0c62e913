"""The physical KV block record and the key it is cached under."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from kvservice.hashing import BlockHash

# A block hash with the KV-cache group appended (4 bytes, big-endian): the prefix index key, so one
# request hash maps to one block per group.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big")


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block. The free-list links live inside the block (intrusive list) so that
    removing a block from the middle of the free queue is O(1) and allocates nothing.

    `_block_hash_num_tokens` is the prefix length the primary key covers: a full block's end, or a
    boundary inside the block for a partial (sub-block) prefix entry. (vLLM's `pool` field, which
    routes frees across pools for its HiSparse host tier, is left out: it costs every block 8 bytes
    and the decode path ~5%.)"""

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    _block_hash_num_tokens: int | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: BlockHashWithGroupId, num_tokens: int | None = None) -> None:
        if self._block_hash is not None or self._block_hash_num_tokens is not None:
            raise AssertionError(f"block {self.block_id} already has a hash; reset it first")
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self._block_hash = None
        self._block_hash_num_tokens = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"_block_hash={self._block_hash!r}, _block_hash_num_tokens={self._block_hash_num_tokens}, "
                f"prev_free_block={prev_id}, next_free_block={next_id})")


def null_head_len(blocks: Sequence[KVCacheBlock]) -> int:
    """Leading null blocks of a table (a window's skipped prefix): binary search, then a C-speed
    check that the run is really one shared null object."""
    if not blocks or not blocks[0].is_null:
        return 0
    lo, hi = 1, len(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks[mid].is_null:
            lo = mid + 1
        else:
            hi = mid
    if blocks[:lo].count(blocks[0]) == lo:
        return lo
    return next(i for i, b in enumerate(blocks) if not b.is_null)


def trim_null_head(blocks: Sequence[KVCacheBlock]) -> Sequence[KVCacheBlock]:
    n = null_head_len(blocks)
    return blocks[n:] if n else blocks
