"""kvservice's forks in a single-type manager: a child request's table is a copy of its parent's, and a
write into a block a sibling still holds goes to a fresh copy (fork copy-on-write). `CopyOnWrite` holds the
pending copies of one manager; `Forks` is the part of SingleTypeManager that makes them (it uses the
manager's req_to_blocks, num_cached_block, block_pool, block_size, kv_cache_group_id, cow and
copy_on_write)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvservice.core.block import KVCacheBlock, make_block_hash_with_group_id

if TYPE_CHECKING:
    from kvservice.core.request import Request

_NO_INDICES: list[int] = []  # shared empty results (never mutated)
_NO_SWAPS: list[tuple[int, int]] = []


class CopyOnWrite:
    """Pending fork copy-on-write copies of one KV-cache manager. Each source block carries one extra
    reference (a pin) until the copies are drained, so its data outlives its last holder."""

    __slots__ = ("pairs", "pins")

    def __init__(self) -> None:
        self.pairs: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self.pins: dict[int, int] = {}

    def add(self, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        self.pairs.append((src, dst))
        self.pins[src.block_id] = self.pins.get(src.block_id, 0) + 1

    def holders(self, block: KVCacheBlock) -> int:
        """References held by request tables (pins not counted)."""
        return block.ref_cnt - self.pins.get(block.block_id, 0)


class Forks:
    """SingleTypeManager's fork and fork copy-on-write."""

    def cow_indices(self, request_id: str, total_computed_tokens: int, num_tokens: int,
                    writer: Request | None = None) -> list[int]:
        """Indices of held blocks this allocation writes into that another request's table holds. With
        `writer` (the request) given, a block cached under the writer's own hash for that index is not
        among them: it holds the writer's KV already (vLLM's bounded replay recomputes a hit's last
        window into such blocks, and copies nothing)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or not self.copy_on_write:
            return _NO_INDICES
        bs = self.block_size
        first = total_computed_tokens // bs
        last = min(len(blocks), -(-num_tokens // bs))
        if first >= last:  # the common decode case at a block boundary: nothing held is written
            return _NO_INDICES
        out = _NO_INDICES
        own = None
        for i in range(first, last):
            block = blocks[i]
            # ref_cnt > 1 first: the common unshared case never looks at the pins. A block keyed at a
            # boundary inside it is shared by a partial prefix hit, which copies on the hitter's side.
            if (block.ref_cnt > 1 and not block.is_null and self.cow.holders(block) > 1
                    and (block._block_hash is None or not (block._block_hash_num_tokens or 0) % bs)):
                if block._block_hash is not None and writer is not None:
                    if own is None:
                        own = self.block_pool._hashes_at(writer, bs)
                    if i < len(own) and block._block_hash == make_block_hash_with_group_id(
                            own[i], self.kv_cache_group_id):
                        continue
                out = [*out, i]
        return out

    def apply_copy_on_write(self, request_id: str, total_computed_tokens: int, num_tokens: int,
                            writer: Request | None = None) -> list[tuple[int, int]]:
        """Swaps a fresh block into this request's table for every shared block it will write; the
        copy (src, dst) is recorded when the shared block already holds computed tokens.

        Returns:
            (index, new block id) for every swapped table entry.
        """
        indices = self.cow_indices(request_id, total_computed_tokens, num_tokens, writer)
        if not indices:
            return _NO_SWAPS
        blocks = self.req_to_blocks[request_id]
        fresh = self.block_pool.get_new_blocks(len(indices))
        for i, dst in zip(indices, fresh, strict=True):
            src = blocks[i]
            blocks[i] = dst
            if i * self.block_size < total_computed_tokens:
                self.cow.add(src, dst)  # the writer's reference becomes the pin
            else:
                self.block_pool.free_blocks([src])
        return [(i, dst.block_id) for i, dst in zip(indices, fresh)]

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's table is a copy of the parent's: every block gains a reference."""
        if self.req_to_blocks.get(parent_id):
            blocks = list(self.req_to_blocks[parent_id])
            for block in blocks:
                if not block.is_null:
                    block.ref_cnt += 1
            self.req_to_blocks[child_id] = blocks
        if parent_id in self.num_cached_block:
            self.num_cached_block[child_id] = self.num_cached_block[parent_id]
