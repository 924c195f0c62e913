"""One external pool's prefix index: what a stock vLLM engine holds, rebuilt from its KV events.

    Node per block content: key = kvservice's chain hash of the block's tokens chained after its parent's key,
    at the allocator's hash block size (an event block of B = k * h tokens has the key of its last h-block),
    so `Lookup(tokens)` finds it without trusting the engine's hash spec, and one prompt hash serves every
    pool. The engine's hashes are aliases (by_engine), used to resolve parents and removals.

Semantics that make a Lookup equal vLLM's `get_computed_blocks`:
- counts, not flags: vLLM caches two physical blocks under one hash when two requests computed the same
  block (identical decodes); each is stored and removed on its own, so a block is present while its count
  per tier (medium: GPU, CPU, STORAGE) is positive.
- a block whose count drops to 0 but that still has indexed children stays as a "ghost" (no hits), so its
  children keep their chain and a later re-store revives it in place.
- a BlockStored whose parent is unknown (missed, or evicted here) is kept as an orphan with its tokens and
  adopted, keys computed, when the parent arrives; it never answers a Lookup before that.
- the memory bound (`max_blocks`, nodes + orphans): orphans go first, oldest first; then leaves, least
  recently stored first (a parent only becomes evictable once its last child is gone, so what stays is
  always a prefix-closed tree that Lookups can reach).
Everything is a pure function of the events applied, in order (the WAL replays them).
"""

from __future__ import annotations

from collections import deque

import msgpack
import xxhash

from kvservice.external.frames import EngineHash, Removed, Stored
from kvservice.external.nodes import COUNT_BITS, COUNT_MASK, TIER_OF, TIERS, IndexCounters, Node, Orphan
from kvservice.hashing import hash_packed_blocks, le_bytes, root_hash

_SEALED = b"\xff"  # a tag kvservice's chain never produces: blocks keyed with it never match a token Lookup
_h128 = xxhash.xxh3_128_digest


class ExternalIndex:
    def __init__(self, hash_block_size: int, hash_seed: str, max_blocks: int, group_idx: int = 0) -> None:
        self.hash_block_size = hash_block_size
        self.hash_seed = hash_seed
        self.root = root_hash(hash_seed)
        self.max_blocks = max_blocks
        self.group_idx = group_idx
        self.counters = IndexCounters()
        # Told each key whose GPU tier comes or goes (kvservice.allocator.global_index); None: nobody listens.
        self.listener = None
        self.by_key: dict[bytes, Node] = {}
        self._empty()

    def listen(self, listener) -> None:
        """`listener` is told every key held on the GPU tier now, then each one that comes or goes."""
        self.listener = listener
        if listener is not None:
            for key in self.listened_keys():
                listener.added(key)

    def listened_keys(self) -> list[bytes]:
        return [key for key, node in self.by_key.items() if node.counts & COUNT_MASK]

    def _empty(self) -> None:
        if self.listener is not None:
            for key in self.listened_keys():
                self.listener.removed(key)
        self.block_size: int | None = None  # learned from the first BlockStored
        self.key_block_size = self.hash_block_size
        self.stride = 1
        self.by_key: dict[bytes, Node] = {}
        self.by_engine: dict[EngineHash, Node] = {}
        self.orphans: dict[EngineHash, Orphan] = {}
        self.waiting: dict[EngineHash, list[Orphan]] = {}  # parent engine hash -> its orphans
        self.orphan_queue: deque[Orphan] = deque()
        self.leaves: deque[Node] = deque()
        self.tier_blocks = [0] * len(TIERS)  # nodes present per tier

    # ---- reads ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.by_key) + len(self.orphans)

    def hits(self, fine_hashes: list[bytes], num_tokens: int) -> list[int]:
        """Cached prefix tokens per tier, as vLLM's `get_computed_blocks` counts them (whole blocks, never
        the last token). `fine_hashes`: the prompt's kvservice-chain hashes at `key_block_size`."""
        out = [0] * len(TIERS)
        size = self.block_size
        if size is None or num_tokens <= 1:
            return out
        stride = self.stride
        num_blocks = min((num_tokens - 1) // size, len(fine_hashes) // stride)
        get = self.by_key.get
        if not (self.tier_blocks[1] or self.tier_blocks[2]):  # GPU only: the common case, one test per block
            for j in range(num_blocks):
                node = get(fine_hashes[(j + 1) * stride - 1])
                if node is None or not node.counts & COUNT_MASK:
                    out[0] = j * size
                    return out
            out[0] = num_blocks * size
            return out
        alive = (1 << len(TIERS)) - 1
        for j in range(num_blocks):
            node = get(fine_hashes[(j + 1) * stride - 1])
            counts = node.counts if node is not None else 0
            for t in range(len(TIERS)):
                if alive >> t & 1 and not (counts >> (t * COUNT_BITS)) & COUNT_MASK:
                    alive &= ~(1 << t)
                    out[t] = j * size
            if not alive:
                return out
        for t in range(len(TIERS)):
            if alive >> t & 1:
                out[t] = num_blocks * size
        return out

    # ---- events --------------------------------------------------------------------------------
    def clear(self) -> None:
        self.counters.clears += 1
        self._empty()

    def reset(self) -> None:
        """A new epoch or a resync: nothing the engine held before is known any more."""
        self._empty()

    def apply_stored(self, ev: Stored) -> None:
        tier = TIER_OF.get(ev.medium)
        n = len(ev.block_hashes)
        size = ev.block_size
        if tier is None or ev.group_idx != self.group_idx or len(ev.token_ids) != n * size:
            self.counters.ignored_events += 1
            return
        if self.block_size is None:
            self.learn_block_size(size)
        elif size != self.block_size:
            self.counters.ignored_events += 1
            return
        if not n:
            return
        self.counters.stored_blocks += n
        packed = le_bytes(ev.token_ids)
        width = 4 * size
        extras = [_split_extra(ev.extra_keys[i] if ev.extra_keys else None, ev.lora_name) for i in range(n)]
        parent = None
        if ev.parent is not None:
            parent = self.by_engine.get(ev.parent)
            if parent is None:
                self._add_orphans(ev, packed, extras, tier)
                return
        inc = 1 << (tier * COUNT_BITS)
        if ev.lora_name is None and not ev.extra_keys:  # one hashing call for the whole event
            fine = hash_packed_blocks(packed, self.key_block_size, parent.key if parent else self.root)
            stride = self.stride
            by_key, by_engine, leaves = self.by_key, self.by_engine, self.leaves
            added = self.listener.added if tier == 0 and self.listener is not None else None
            num_new = 0
            for i, engine in enumerate(ev.block_hashes):
                key = fine[(i + 1) * stride - 1]
                if key in by_key or self.waiting:
                    parent = self._insert(key, engine, parent, inc, tier)
                    continue
                # A block never seen (the common case), inlined: `_insert`'s first branch.
                node = Node(key, engine, parent, inc)
                by_key[key] = by_engine[engine] = node
                if parent is not None:
                    parent.children += 1
                node.queued = 1
                leaves.append(node)
                if added is not None:
                    added(key)
                parent = node
                num_new += 1
            self.tier_blocks[tier] += num_new
            self._bound()
            return
        for i, engine in enumerate(ev.block_hashes):
            salt, sealed = extras[i]
            key = self._key(parent, packed[i * width:(i + 1) * width], salt, ev.lora_name, sealed)
            parent = self._insert(key, engine, parent, inc, tier)
        self._bound()

    def apply_removed(self, ev: Removed) -> None:
        tier = TIER_OF.get(ev.medium)
        if tier is None or ev.group_idx != self.group_idx:
            self.counters.ignored_events += 1
            return
        shift = tier * COUNT_BITS
        for engine in ev.block_hashes:
            node = self.by_engine.get(engine)
            if node is None:
                orphan = self.orphans.get(engine)
                if orphan is None:
                    self.counters.unknown_removals += 1
                else:
                    self._forget(orphan)
                    self.counters.removed_blocks += 1
                continue
            if not (node.counts >> shift) & COUNT_MASK:
                self.counters.unknown_removals += 1
                continue
            self.counters.removed_blocks += 1
            node.counts -= 1 << shift
            if not (node.counts >> shift) & COUNT_MASK:
                self.tier_blocks[tier] -= 1
                if tier == 0 and self.listener is not None:
                    self.listener.removed(node.key)
            if not node.counts and not node.children:
                self._delete(node)

    # ---- mechanism -----------------------------------------------------------------------------
    def learn_block_size(self, size: int) -> None:
        self.block_size = size
        h = self.hash_block_size
        self.key_block_size = h if size % h == 0 else size
        self.stride = size // self.key_block_size

    def _key(self, parent: Node | None, packed: bytes, salt: str | None, lora: str | None, sealed: bytes) -> bytes:
        parent_key = parent.key if parent is not None else self.root
        if sealed:
            return _h128(parent_key + packed + _SEALED + sealed)
        first = 0 if parent is None else 1  # the chain puts the cache salt in block 0 only
        fine = hash_packed_blocks(packed, self.key_block_size, parent_key, first, salt if first == 0 else None, lora)
        return fine[-1]

    def _insert(self, key: bytes, engine: EngineHash, parent: Node | None, inc: int, tier: int,
                adopt: bool = True) -> Node:
        node = self.by_key.get(key)
        shift = tier * COUNT_BITS
        if node is None:
            node = Node(key, engine, parent, inc)
            self.by_key[key] = node
            self.by_engine[engine] = node
            if parent is not None:
                parent.children += 1
            self.tier_blocks[tier] += 1
            self.push_leaf(node)
            if tier == 0 and self.listener is not None:
                self.listener.added(key)
        else:
            if node.counts:
                self.counters.duplicate_stores += 1
            if self.by_engine.get(engine) is not node:
                self._alias(node, engine)
            count = (node.counts >> shift) & COUNT_MASK
            if count == 0:
                self.tier_blocks[tier] += 1
                if tier == 0 and self.listener is not None:
                    self.listener.added(key)
            if count < COUNT_MASK:  # saturates rather than carrying into the next tier
                node.counts += inc
            if not node.children:
                self.push_leaf(node)  # stored again: the most recently used leaf
        if adopt and self.waiting:
            self._adopt(engine, node)
        return node

    def _alias(self, node: Node, engine: EngineHash) -> None:
        old = self.by_engine.get(engine)
        if old is not None:  # the engine reused a hash for other content (a collision): the newest wins
            self._unalias(old, engine)
        self.by_engine[engine] = node
        node.engine = [*node.engine, engine] if isinstance(node.engine, list) else [node.engine, engine]

    @staticmethod
    def _unalias(node: Node, engine: EngineHash) -> None:
        if isinstance(node.engine, list) and engine in node.engine:
            node.engine.remove(engine)

    def push_leaf(self, node: Node) -> None:
        node.queued += 1
        self.leaves.append(node)

    def _delete(self, node: Node) -> None:
        """Removes a node with no children and no copies left (and ghosts above it that it kept)."""
        while True:
            del self.by_key[node.key]
            for engine in node.engine if isinstance(node.engine, list) else (node.engine,):
                if self.by_engine.get(engine) is node:
                    del self.by_engine[engine]
            parent = node.parent
            if parent is None:
                return
            parent.children -= 1
            if parent.children:
                return
            if parent.counts:
                self.push_leaf(parent)
                return
            node = parent  # a ghost that only its children kept

    def _evict_leaf(self) -> bool:
        leaves = self.leaves
        while leaves:
            node = leaves.popleft()
            node.queued -= 1
            if node.queued or node.children or self.by_key.get(node.key) is not node:
                continue  # a newer entry exists, it is a parent now, or it is gone
            for t in range(len(TIERS)):
                if (node.counts >> (t * COUNT_BITS)) & COUNT_MASK:
                    self.tier_blocks[t] -= 1
            if node.counts & COUNT_MASK and self.listener is not None:
                self.listener.removed(node.key)
            node.counts = 0
            self._delete(node)
            self.counters.evictions += 1
            return True
        return False

    def live_leaves(self) -> list[Node]:
        """The leaf queue's entries that count (each live leaf's last one), oldest first."""
        seen: set[int] = set()
        live: list[Node] = []
        for node in reversed(self.leaves):
            if id(node) not in seen:
                seen.add(id(node))
                if not node.children and self.by_key.get(node.key) is node:
                    live.append(node)
        live.reverse()
        return live

    def _bound(self) -> None:
        if len(self.leaves) + len(self.orphan_queue) > 2 * (len(self.by_key) + len(self.orphans)) + 1024:
            self._compact()
        while len(self.by_key) + len(self.orphans) > self.max_blocks:
            if not self._drop_orphan() and not self._evict_leaf():
                return

    # ---- orphans ---------------------------------------------------------------------------------
    def _add_orphans(self, ev: Stored, packed: bytes, extras: list, tier: int) -> None:
        width = 4 * ev.block_size
        parent = ev.parent
        for i, engine in enumerate(ev.block_hashes):
            salt, sealed = extras[i]
            if engine not in self.orphans:
                orphan = Orphan(engine, parent, packed[i * width:(i + 1) * width], salt, ev.lora_name, sealed, tier)
                self.orphans[engine] = orphan
                self.waiting.setdefault(parent, []).append(orphan)
                self.orphan_queue.append(orphan)
                self.counters.orphans_added += 1
            parent = engine
        self._bound()

    def _adopt(self, engine: EngineHash, node: Node) -> None:
        """Indexes the orphans waiting for `engine` (and theirs, transitively) under `node`."""
        stack = [(engine, node)]
        while stack:
            parent_engine, parent = stack.pop()
            for orphan in self.waiting.pop(parent_engine, ()):
                if self.orphans.get(orphan.engine) is not orphan:
                    continue  # removed or evicted meanwhile
                del self.orphans[orphan.engine]
                key = self._key(parent, orphan.tokens, orphan.salt, orphan.lora, orphan.sealed)
                child = self._insert(key, orphan.engine, parent, 1 << (orphan.tier * COUNT_BITS), orphan.tier, False)
                self.counters.orphans_adopted += 1
                stack.append((orphan.engine, child))

    def _forget(self, orphan: Orphan) -> None:
        del self.orphans[orphan.engine]
        siblings = self.waiting.get(orphan.parent)
        if siblings is not None:
            siblings.remove(orphan)
            if not siblings:
                del self.waiting[orphan.parent]

    def _drop_orphan(self) -> bool:
        queue = self.orphan_queue
        while queue:
            orphan = queue.popleft()
            if self.orphans.get(orphan.engine) is orphan:
                self._forget(orphan)
                self.counters.orphans_dropped += 1
                return True
        return False

    def _compact(self) -> None:
        """Drops the queues' dead entries (they pile up while the pool is under its bound): keeps each live
        leaf's last entry and each live orphan, in order. Eviction order is unchanged."""
        for node in self.leaves:
            node.queued = 0
        live = self.live_leaves()
        for node in live:
            node.queued = 1
        self.leaves = deque(live)
        self.orphan_queue = deque(o for o in self.orphan_queue if self.orphans.get(o.engine) is o)


def _split_extra(published, lora_name: str | None) -> tuple[str | None, bytes]:
    """(cache salt, sealed extras) of one block's published extra keys: LoRA name first (when the event has
    one), then multimodal (identifier, offset) pairs, the cache salt, prompt-embedding digests. Multimodal
    items and embeddings have no token form a Lookup could match: such blocks are sealed."""
    if not published:
        return None, b""
    items = list(published)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    salt = None
    rest = []
    for item in items:
        if isinstance(item, str) and salt is None:
            salt = item
        else:
            rest.append(item)
    return salt, (msgpack.packb(rest, use_bin_type=True) if rest else b"")
