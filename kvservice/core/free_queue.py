"""The free-block queue: an intrusive doubly linked list with sentinels.

Its order is the eviction policy: allocation pops from the head; freed unhashed blocks are
prepended (reused first) and freed cached blocks appended (least recently used evicted first).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvservice.core.block import KVCacheBlock


class FreeBlockQueue:
    """O(1) popleft / append / middle removal without allocating Python objects per operation.

    Starts ordered by the given blocks' order (block id order for a fresh pool).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            raise ValueError("No free blocks available")
        self._unlink(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pops the first n blocks in queue order; the caller checked there are n."""
        if n == 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        out = []
        append = out.append
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of block {block.block_id}, which is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def _unlink(self, block: KVCacheBlock) -> None:
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.fake_free_list_tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Appends blocks at the tail, keeping their order."""
        last = self.fake_free_list_tail.prev_free_block
        if last is None:
            raise AssertionError("the free queue's tail sentinel lost its link")
        n = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            n += 1
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += n

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Inserts blocks at the head, keeping their order: prepending [4, 5] then [1, 2] to [0]
        pops as 1, 2, 4, 5, 0."""
        if not blocks:
            return
        first = self.fake_free_list_head.next_free_block
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail:
            out.append(block)
            block = block.next_free_block
        return out

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order after `cursor` (None: from the head)."""
        block = self.fake_free_list_head.next_free_block if cursor is None else cursor.next_free_block
        tail = self.fake_free_list_tail
        while block is not None and block is not tail:
            yield block
            block = block.next_free_block
