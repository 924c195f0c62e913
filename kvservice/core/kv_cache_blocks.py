"""KVCacheBlocks: one request's blocks per KV-cache group, the manager's answer to the scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvservice.core.block import KVCacheBlock, trim_null_head


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks of one request, one sequence per KV-cache group. From `allocate_slots`, `replaced` lists
    the (group, index, new block id) table entries that fork copy-on-write swapped (their old blocks
    are the sources of `take_block_copies()`)."""

    blocks: tuple[Sequence[KVCacheBlock], ...]
    replaced: list[tuple[int, int, int]] = field(default_factory=list)

    def get_block_ids(self, allow_none: bool = False, *,
                      group_ids: Sequence[int] | None = None) -> tuple[list[int], ...] | None:
        """One id list per group (`group_ids`: only those); None when `allow_none` and all are empty."""
        groups = self.blocks if group_ids is None else tuple(self.blocks[g] for g in group_ids)
        if allow_none and all(len(g) == 0 for g in groups):
            return None
        return tuple([b.block_id for b in g] for g in groups)

    def get_unhashed_block_ids(self) -> list[int]:
        if len(self.blocks) != 1:
            raise AssertionError("get_unhashed_block_ids serves one group only")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[b.block_id for b in trim_null_head(g) if b.block_hash is None and not b.is_null]
                for g in self.blocks]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))
