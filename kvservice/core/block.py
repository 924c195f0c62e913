"""The physical KV block record and the key it is cached under."""

from __future__ import annotations

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
    removing a block from the middle of the free queue is O(1) and allocates nothing."""

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, key: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise RuntimeError(f"block {self.block_id} already has a hash; reset it first")
        self._block_hash = key

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"block_hash={self._block_hash!r}, prev={prev_id}, next={next_id}, is_null={self.is_null})")
