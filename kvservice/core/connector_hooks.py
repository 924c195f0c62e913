"""The KV-connector-facing side of KVCacheManager (vLLM 0.33.0's names): draining new block ids to
zero, partial-hit copies and boundary-state hand-offs, and views of a request's blocks that offloading
and external KV loads need. A mixin: it reads the manager's coordinator and nothing else."""

from __future__ import annotations

from typing import NamedTuple

from kvservice.core.block import KVCacheBlock
from kvservice.core.kv_cache_blocks import KVCacheBlocks
from kvservice.core.managers import CrossAttentionManager, MambaManager
from kvservice.core.managers.base import cdiv


class KVCacheBlockCopy(NamedTuple):
    src_block_id: int
    dst_block_id: int


class ConnectorHooks:
    """Mixed into KVCacheManager (needs `coordinator` and `create_kv_cache_blocks`)."""

    def take_new_block_ids(self) -> list[int]:
        """New attention block ids since the last call, for the workers to zero."""
        ids: list[int] = []
        for m in self.coordinator.single_type_managers:
            ids.extend(m.take_new_block_ids())
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Records the request's blocks from `start_token` (block aligned) for zeroing again, e.g. the
        ones a failed external load left unwritten."""
        for m in self.coordinator.single_type_managers:
            if m.records_new_block_ids:
                if start_token % m.block_size:
                    raise ValueError(f"start_token {start_token} is not a multiple of the block size {m.block_size}")
                m.new_block_ids.extend(b.block_id for b in m.req_to_blocks[request_id][start_token // m.block_size:])

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Partial-hit copies to run, and their endpoints, which stay retained: the caller frees them
        once the copies ran."""
        pending: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for m in self.coordinator.single_type_managers:
            pending.extend(m.take_pending_cow_copies())
        return ([KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pending],
                [block for pair in pending for block in pair])

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """{request id: [(group, block id, boundary tokens)]}: committed Mamba "align" boundary states
        a connector may offload (read the blocks named, never by position)."""
        out: dict[str, list[tuple[int, int, int]]] = {}
        for m in self.coordinator.single_type_managers:
            for request_id, group_id, block, boundary in m.take_pending_boundary_state_offloads():
                out.setdefault(request_id, []).append((group_id, block.block_id, boundary))
        return out

    def finalize_partial_tail_offloads(self, request) -> list[tuple[int, int, int]]:
        """A finishing request's own partial-tail states that are still valid to offload."""
        out = []
        for m in self.coordinator.single_type_managers:
            done = m.finalize_partial_tail_offload(request.request_id, request.num_computed_tokens,
                                                   getattr(request, "num_in_flight_tokens", 0))
            if done is not None:
                group_id, block, boundary = done
                out.append((group_id, block.block_id, boundary))
        return out

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """Each attention group's ids covering the computed tokens (other groups whole)."""
        out = []
        for m, ids in zip(self.coordinator.single_type_managers, self.get_block_ids(request_id)):
            if isinstance(m, (MambaManager, CrossAttentionManager)):
                out.append(ids)
            else:
                out.append(ids[:cdiv(num_computed_tokens, m.spec.block_size)])
        return tuple(out)

    def estimate_cached_tokens(self, request) -> int:
        """Tokens the prefix cache holds for the request: the smallest, over cacheable groups, of the
        longest prefix one of its blocks is keyed at."""
        cached = None
        for m, blocks in zip(self.coordinator.single_type_managers, self.get_blocks(request.request_id).blocks):
            if not m.spec.prefix_cacheable or isinstance(m, CrossAttentionManager):
                continue
            group = max((b.block_hash_num_tokens or 0 for b in blocks), default=0)
            cached = group if cached is None else min(cached, group)
        return cached or 0

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        """A lookup result cut at an aligned token count (no reference changes); a Mamba group may be
        shorter (an external load can supply its last state)."""
        out: list[list[KVCacheBlock]] = []
        for group_blocks, m in zip(blocks.blocks, self.coordinator.single_type_managers):
            if not m.spec.prefix_cacheable:
                if group_blocks:
                    raise AssertionError("a scratch group never has computed blocks")
                out.append([])
                continue
            if num_computed_tokens % m.block_size:
                raise ValueError(f"{num_computed_tokens} tokens are not a multiple of the block size {m.block_size}")
            n = num_computed_tokens // m.block_size
            if isinstance(m, MambaManager):
                n = min(n, len(group_blocks))
            elif n > len(group_blocks):
                raise ValueError(f"{num_computed_tokens} tokens are more than the {len(group_blocks)} blocks given")
            out.append(list(group_blocks[:n]))
        return self.create_kv_cache_blocks(tuple(out))

    def get_computed_blocks_for_connector(self, request, max_cache_hit_length: int | None = None):
        """The local hit for a request a KV connector may extend: in a hybrid Mamba pool, the
        full-attention hit (the connector supplies the rest), and whether a lagging group hit less.

        Returns:
            (blocks, local hit tokens, shared-prefix boundary, hit diverged).
        """
        coordinator = self.coordinator
        if not (self.config.has_mamba_layers and getattr(coordinator, "full_attention_group_id", None) is not None):
            return (*self.find_computed_blocks(request, max_cache_hit_length, record_stats=False), False)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        fa = coordinator.full_attention_group_id
        computed, hits = coordinator.find_longest_cache_hit_per_group(request.block_hashes, max_cache_hit_length)
        if any(h > hits[fa] for h in hits):
            return (*self.find_computed_blocks(request, max_cache_hit_length, record_stats=False), False)
        return self.create_kv_cache_blocks(computed), hits[fa], 0, min(hits) < hits[fa]
