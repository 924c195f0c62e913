"""Blocks a vLLM scheduler holds outside every request's table (vLLM 0.33.0's copy retentions).

vLLM's scheduler drains the step's partial-hit copies with `take_kv_cache_block_copies()` and keeps both
ends of each copy referenced until the step that runs the copy has been processed; then it hands them back
with `block_pool.free_blocks(...)`. A scheduler (or a test of vLLM's) may also take blocks straight from the
block pool (`block_pool.get_new_blocks(n)`), and a KV connector may pin blocks it offloads
(`block_pool.touch(blocks)`); both return them the same way. Such a reference belongs to no
request, so the pool keeps a ledger of them: a block id is held as many times as it was handed out, and
only what is held can be returned. The ledger counts in the invariants (a held reference is one of a block's
references) and is in the pool's snapshots.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from kvservice.core.block_pool import BlockPool

# The most references one block may be held by outside requests' tables: far above what a scheduler or a
# connector holds (a copy's two ends for a step or two, a block pinned per store job), and low enough that a
# client touching one block over and over cannot overflow its reference count or the snapshots.
MAX_HELD_PER_BLOCK = 65_535


class HeldBlocks:
    """Block id -> references held outside any request (see the module's docstring)."""

    def __init__(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.counts: Counter[int] = Counter()

    def __len__(self) -> int:
        return sum(self.counts.values())

    def take_copies(self, managers: Iterable, taken: Sequence[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """Drains the managers' pending partial-hit copies, returned as (src, dst) block ids; the references that
        kept both ends alive are held from now on.

        `taken`: the copies the scheduler took (None: these). Each pending copy must be among them, and a pair
        the pool did not make must name blocks held already (their references stand for it: a scheduler that
        copies blocks it took itself). ValueError, nothing changed, otherwise."""
        managers = [m for m in managers if m._pending_cow_copies]
        made = [(src, dst) for m in managers for src, dst in m._pending_cow_copies]
        made_ids = [(src.block_id, dst.block_id) for src, dst in made]
        counts = self.counts
        if taken is not None:
            missing = Counter(made_ids) - Counter(taken)
            if missing:
                raise ValueError(f"the pool made copies (src, dst) {sorted(missing)[:4]} that the scheduler did not "
                                 f"take")
            others = Counter(taken) - Counter(made_ids)
            need = Counter(block_id for pair in others.elements() for block_id in pair)
            short = next((b for b, n in sorted(need.items()) if counts[b] < n), None)
            if short is not None:
                raise ValueError(f"the scheduler took a copy of block {short}, which the pool neither copied nor "
                                 f"holds outside requests' tables ({counts[short]} held, {need[short]} named)")
        for manager in managers:
            manager.take_pending_cow_copies()
        for src, dst in made_ids:
            counts[src] += 1
            counts[dst] += 1
        return made_ids

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """`num_blocks` blocks from the head of the free queue, held; ValueError (nothing taken) when fewer are
        free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks}")
        blocks = self.block_pool.get_new_blocks(num_blocks)  # (fresh blocks: held once each, under any cap)
        ids = [b.block_id for b in blocks]
        self.counts.update(ids)
        return ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """A held reference on each (the block pool's touch: a free block leaves the free queue, still cached);
        the null block is skipped. ValueError, nothing touched, when a block would be held more than
        MAX_HELD_PER_BLOCK times."""
        blocks = self.block_pool.blocks
        touched = [blocks[i] for i in block_ids if not blocks[i].is_null]
        wanted = Counter(b.block_id for b in touched)
        over = next((b for b, n in sorted(wanted.items()) if self.counts[b] + n > MAX_HELD_PER_BLOCK), None)
        if over is not None:
            raise ValueError(f"block {over} would be held {self.counts[over] + wanted[over]} times outside "
                             f"requests' tables, over the limit of {MAX_HELD_PER_BLOCK}")
        self.block_pool.touch(touched)
        self.counts.update(wanted)

    def free(self, block_ids: Sequence[int]) -> None:
        """Returns held references in this order (the block pool's free_blocks: a block whose last reference
        this was goes back to the free queue). ValueError, nothing returned, when an id is named more often than
        it is held."""
        wanted = Counter(block_ids)
        counts = self.counts
        for block_id, n in wanted.items():
            if counts[block_id] < n:
                raise ValueError(f"block {block_id} is named {n} times but held {counts[block_id]} times outside "
                                 f"requests' tables: only a copy retention's or a direct take's blocks return")
        for block_id, n in wanted.items():
            counts[block_id] -= n
            if not counts[block_id]:
                del counts[block_id]
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks([blocks[i] for i in block_ids])

    def pairs(self) -> list[tuple[int, int]]:
        """(block id, times held), in id order."""
        return sorted(self.counts.items())

    def restore(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Sets the ledger from `pairs()` (a snapshot's); the block pool's reference counts already include
        them."""
        self.counts = Counter(dict(pairs))
