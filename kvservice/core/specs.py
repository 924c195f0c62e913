"""KV-cache group specs and the pool configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _check_positive(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(slots=True, frozen=True)
class FullAttentionSpec:
    block_size: int

    def __post_init__(self) -> None:
        _check_positive("FullAttentionSpec", "block_size", self.block_size)


@dataclass(slots=True, frozen=True)
class SlidingWindowSpec:
    """The token at position p attends to positions (p - sliding_window, p]."""

    block_size: int
    sliding_window: int

    def __post_init__(self) -> None:
        _check_positive("SlidingWindowSpec", "block_size", self.block_size)
        _check_positive("SlidingWindowSpec", "sliding_window", self.sliding_window)


@dataclass(slots=True, frozen=True)
class ChunkedLocalAttentionSpec:
    """Tokens attend only within their chunk of `attention_chunk_size` positions."""

    block_size: int
    attention_chunk_size: int

    def __post_init__(self) -> None:
        _check_positive("ChunkedLocalAttentionSpec", "block_size", self.block_size)
        _check_positive("ChunkedLocalAttentionSpec", "attention_chunk_size", self.attention_chunk_size)


@dataclass(slots=True, frozen=True)
class MambaSpec:
    """A recurrent state cached at block boundaries; a hit keeps only the last state block."""

    block_size: int

    def __post_init__(self) -> None:
        _check_positive("MambaSpec", "block_size", self.block_size)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | MambaSpec
SPEC_TYPES = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)


@dataclass(slots=True)
class KVCacheConfig:
    """`num_blocks` includes the null block; every group allocates from the same pool."""

    num_blocks: int
    groups: list[KVCacheSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or isinstance(self.num_blocks, bool) or self.num_blocks < 2:
            raise ValueError(f"KVCacheConfig.num_blocks must be an int >= 2 (null block + 1), got {self.num_blocks!r}")
        if not self.groups:
            raise ValueError("KVCacheConfig.groups must hold at least one spec")
        for i, spec in enumerate(self.groups):
            if not isinstance(spec, SPEC_TYPES):
                raise ValueError(f"KVCacheConfig.groups[{i}] is not a KV-cache spec: {spec!r}")


def effective_block_size(spec: KVCacheSpec, dcp_world_size: int = 1) -> int:
    """Tokens one allocator block spans: DCP shards full-attention blocks across W ranks."""
    if isinstance(spec, FullAttentionSpec):
        return spec.block_size * dcp_world_size
    if dcp_world_size != 1:
        raise ValueError(f"{type(spec).__name__} does not support decode context parallelism "
                         f"(dcp_world_size={dcp_world_size}); only full attention does")
    return spec.block_size


def gcd_block_size(config: KVCacheConfig, dcp_world_size: int = 1) -> int:
    return math.gcd(*(effective_block_size(s, dcp_world_size) for s in config.groups))


def lcm_block_size(config: KVCacheConfig, dcp_world_size: int = 1) -> int:
    return math.lcm(*(effective_block_size(s, dcp_world_size) for s in config.groups))
