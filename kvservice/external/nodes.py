"""The records of an external pool's prefix index (kvservice.external.index): a node per indexed block
content with its copies per tier, an orphan per block stored before its parent, and the index's counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvservice.external.frames import EngineHash

TIERS = ("GPU", "CPU", "STORAGE")
TIER_OF = {None: 0, "GPU": 0, "CPU": 1, "STORAGE": 2}
COUNT_BITS = 16
COUNT_MASK = (1 << COUNT_BITS) - 1


def tier_count(counts: int, tier: int) -> int:
    """A node's number of copies in one tier (`counts` packs 16 bits per tier)."""
    return (counts >> (tier * COUNT_BITS)) & COUNT_MASK


class Node:
    """One indexed block content. `engine`: its engine hash, or a list of them (aliases of one content)."""

    __slots__ = ("key", "engine", "parent", "counts", "children", "queued")

    def __init__(self, key: bytes, engine: EngineHash, parent: Node | None, counts: int) -> None:
        self.key = key
        self.engine: EngineHash | list[EngineHash] = engine
        self.parent = parent
        self.counts = counts  # 16 bits per tier
        self.children = 0
        self.queued = 0  # entries in the leaf queue (only the last one counts)


class Orphan:
    """A stored block whose parent is not indexed: its content, kept until the parent arrives."""

    __slots__ = ("engine", "parent", "tokens", "salt", "lora", "sealed", "tier")

    def __init__(self, engine: EngineHash, parent: EngineHash, tokens: bytes, salt: str | None, lora: str | None,
                 sealed: bytes, tier: int) -> None:
        self.engine, self.parent, self.tokens, self.salt = engine, parent, tokens, salt
        self.lora, self.sealed, self.tier = lora, sealed, tier


@dataclass(slots=True)
class IndexCounters:
    stored_blocks: int = 0
    removed_blocks: int = 0
    duplicate_stores: int = 0  # a content stored again while present (another physical block)
    unknown_removals: int = 0  # BlockRemoved of a hash not indexed (missed store, or evicted here)
    orphans_added: int = 0
    orphans_adopted: int = 0
    orphans_dropped: int = 0  # evicted by the memory bound before their parent arrived
    evictions: int = 0  # indexed blocks evicted by the memory bound
    clears: int = 0  # AllBlocksCleared
    ignored_events: int = 0  # another KV-cache group, an unknown medium, a block size or shape not indexed
