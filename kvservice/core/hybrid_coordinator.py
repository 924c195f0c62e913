"""The hybrid coordinator: several group types agree on one hit by a fixed point in which every spec
group (groups sharing a spec, looked up together) can only shrink the hit; full attention first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvservice.core.block import KVCacheBlock
from kvservice.core.coordinator import KVCacheCoordinator
from kvservice.core.managers import SingleTypeManager
from kvservice.core.managers.base import cdiv
from kvservice.core.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, effective_block_size


def partial_hash_hits_enabled(specs: Sequence[KVCacheSpec], hash_block_size: int, dcp_world_size: int = 1,
                              manager_classes: Sequence[type[SingleTypeManager]] | None = None) -> bool:
    """Sub-block prefix hits: on when a Mamba "align" state block is larger than the hash block
    (or, under DCP, not smaller) and every other cacheable group can look up at hash granularity."""
    if not any(isinstance(s, MambaSpec) and s.mamba_cache_mode == "align"
               and (s.block_size > hash_block_size if dcp_world_size == 1 else s.block_size >= hash_block_size)
               for s in specs):
        return False
    if manager_classes is None:
        return True
    return all(not s.prefix_cacheable or cls.supports_fine_grained_hash_lookup
               or effective_block_size(s, dcp_world_size) == hash_block_size
               for s, cls in zip(specs, manager_classes))


def eagle_proof_margin(block_size: int, hash_block_size: int, fine_grained_lookup: bool) -> int:
    """Tokens an EAGLE group matches past a hit before dropping them (a hash unit when fine-grained)."""
    return hash_block_size if fine_grained_lookup and block_size > hash_block_size else block_size


class SpecGroup(NamedTuple):
    """Groups sharing one spec (and manager and pool): looked up together."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeManager]
    use_eagle: bool


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several group types: every spec group in turn can only shrink the hit, until it is stable."""

    def __init__(self, *args, allow_partial_hash_hits: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        hash_bs = self.hash_block_size
        dcp = self.dcp_world_size = self._dcp_world_size
        for m, spec in zip(self.single_type_managers, self.config.groups):
            if spec.prefix_cacheable and m.block_size % hash_bs != 0:
                raise ValueError(f"group {m.kv_cache_group_id}: block size {m.block_size} is not a multiple of "
                                 f"hash_block_size {hash_bs}")
        self.enable_partial_hash_hits = allow_partial_hash_hits and partial_hash_hits_enabled(
            self.config.groups, hash_bs, dcp, [type(m) for m in self.single_type_managers])
        for m in self.single_type_managers:
            m.cache_hit_alignment_tokens = self._cache_hit_alignment_tokens
            m.partial_tails = True
        self.verify_and_split_kv_cache_groups()

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        return self.hash_block_size if self.enable_partial_hash_hits else self.scheduler_block_size

    def verify_and_split_kv_cache_groups(self) -> None:
        """Batches cacheable groups with equal specs, managers and pools; full attention first (its
        left-to-right scan gives the tightest first bound)."""
        self.attention_groups: list[SpecGroup] = []
        for i, spec in enumerate(self.config.groups):
            if not spec.prefix_cacheable:
                continue
            manager = self.single_type_managers[i]
            use_eagle = i in self.drop_eagle_group_ids
            for idx, group in enumerate(self.attention_groups):
                if (group.spec == spec and group.manager_cls is type(manager)
                        and self.single_type_managers[group.group_ids[0]].block_pool is manager.block_pool):
                    group.group_ids.append(i)
                    if use_eagle and not group.use_eagle:
                        self.attention_groups[idx] = group._replace(use_eagle=True)
                    break
            else:
                self.attention_groups.append(SpecGroup(spec, [i], type(manager), use_eagle))
        if not self.attention_groups:
            raise ValueError("a hybrid pool needs at least one prefix-cacheable group")
        self.attention_groups.sort(key=lambda g: not isinstance(g.spec, FullAttentionSpec))
        first = self.attention_groups[0]
        self.full_attention_group_id = first.group_ids[0] if isinstance(first.spec, FullAttentionSpec) else None
        for group in self.attention_groups:
            if group.use_eagle:
                for g in group.group_ids:
                    self.single_type_managers[g].use_eagle = True

    def _align_cacheable(self, num_tokens: int) -> int:
        """The longest prefix a future hit can match (hits are scheduler-block aligned unless partial
        hash hits are on)."""
        if self.enable_partial_hash_hits:
            return num_tokens
        return num_tokens // self.scheduler_block_size * self.scheduler_block_size

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        cacheable = self._align_cacheable(num_computed_tokens)
        manager = self.single_type_managers[kv_cache_group_id]
        if manager.use_eagle and cacheable > 0:  # EAGLE matches a block past the boundary, then drops it
            final = max(0, num_computed_tokens - self.num_reprefillable_tokens)
            return min(final, self._align_cacheable(final) + manager.block_size)
        return cacheable

    def _lookup(self, group: SpecGroup, block_hashes, max_length: int, drop_eagle: bool):
        manager = self.single_type_managers[group.group_ids[0]]
        if drop_eagle and not isinstance(group.spec, MambaSpec):
            fine = self.enable_partial_hash_hits and group.manager_cls.supports_fine_grained_hash_lookup
            margin = eagle_proof_margin(manager.block_size, self.hash_block_size, fine)
            max_length = min(max_length + margin, len(block_hashes) * self.hash_block_size)
        return group.manager_cls.find_longest_cache_hit(
            block_hashes, max_length, group.group_ids, manager.block_pool, group.spec, drop_eagle,
            self._cache_hit_alignment_tokens, manager.dcp_world_size, manager.pcp_world_size)

    def find_cache_hit(self, block_hashes, max_cache_hit_length):
        num_groups = len(self.config.groups)
        hit_length = max_cache_hit_length
        longest = 0
        hits: list[list[KVCacheBlock] | None] = [None] * num_groups
        hit_lengths = [0] * num_groups
        simple = len(self.attention_groups) == 2 and isinstance(self.attention_groups[0].spec, FullAttentionSpec)
        eagle_verified: set[int] = set()  # each EAGLE group drops at most once per candidate length
        while True:
            length = hit_length
            for idx, group in enumerate(self.attention_groups):
                first = group.group_ids[0]
                if isinstance(group.spec, FullAttentionSpec) and hits[first] is not None:
                    length = min(length, hit_lengths[first])  # downward closed: trimmed at the end
                    continue
                drop = group.use_eagle and idx not in eagle_verified
                blocks, new_length = self._lookup(group, block_hashes, length, drop)
                if drop:
                    eagle_verified.add(idx)
                elif new_length < length:
                    eagle_verified.clear()
                length = new_length
                for g, b in zip(group.group_ids, blocks):
                    hits[g] = b
                    hit_lengths[g] = new_length
                longest = max(longest, length)
            if length >= hit_length:
                break
            hit_length = length
            if simple:
                break
        for group in self.attention_groups:
            if not isinstance(group.spec, FullAttentionSpec):
                continue
            manager = self.single_type_managers[group.group_ids[0]]
            if manager.retains_longer_hit:
                continue
            num_blocks = cdiv(hit_length, manager.block_size)
            for g in group.group_ids:
                if hits[g] is not None:
                    del hits[g][num_blocks:]
                    hit_lengths[g] = hit_length
        return tuple(h if h is not None else [] for h in hits), hit_length, longest - hit_length

    def find_longest_cache_hit_per_group(self, block_hashes, max_cache_hit_length):
        """Each group's own longest hit (no agreement): (blocks per group, hit length per group)."""
        num_groups = len(self.config.groups)
        blocks_out: list[list[KVCacheBlock]] = [[] for _ in range(num_groups)]
        lengths = [0] * num_groups
        for group in self.attention_groups:
            blocks, length = self._lookup(group, block_hashes, max_cache_hit_length, group.use_eagle)
            for g, b in zip(group.group_ids, blocks):
                blocks_out[g] = b
                lengths[g] = length
        return tuple(blocks_out), tuple(lengths)
