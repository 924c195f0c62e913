"""What an engine is configured with and what it counts.

    EngineConfig (pool, its KV-cache groups, budgets, EOS) -> Engine -> EngineStats (tokens, hits, time)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvservice.core import FullAttentionSpec, SlidingWindowSpec
from kvservice.core.specs import effective_block_size

KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(slots=True)
class EngineConfig:
    pool_id: str = "engine-0"
    num_blocks: int = 512  # includes the null block
    block_size: int = 16  # per rank; see tokens_per_block
    dcp_world_size: int = 1
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    epoch: int = 0
    enable_prefix_caching: bool = True
    allow_transfers: bool = False  # adopt prefixes cached on other pools (needs their workers: `peers`)
    kv_layout: str = ""  # pools exchange blocks only with equal layouts (PoolLayout.kv_layout)
    kv_cache_groups: tuple[KVCacheSpec, ...] = ()  # the model's groups (empty: one full-attention group)
    eos_token_ids: tuple[int, ...] = ()  # end a sequence unless its SamplingParams say ignore_eos

    @property
    def groups(self) -> tuple[KVCacheSpec, ...]:
        return self.kv_cache_groups or (FullAttentionSpec(self.block_size),)

    @property
    def max_num_rows(self) -> int:
        """Block-table rows the workers need (running requests plus those being freed or forked)."""
        return 2 * self.max_num_seqs + 8

    def tokens_per_block(self, group: int = 0) -> int:
        """Tokens one allocator block of `group` spans: block_size * dcp_world_size for a DCP-sharded
        group (full attention), block_size for a replicated one (a sliding window)."""
        return effective_block_size(self.groups[group], self.dcp_world_size)

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.max_model_len // (self.block_size * self.dcp_world_size))


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    copies: int = 0
    forks: int = 0
    transfers: int = 0
    transferred_tokens: int = 0
    transfer_s: float = 0.0
    peak_blocks: int = 0
    peak_running: int = 0
    allocator_s: float = 0.0
    model_s: float = 0.0
    total_s: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
