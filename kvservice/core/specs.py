"""KV-cache group specs and the pool configuration (vLLM 0.33.0's semantic fields; no tensor layout).

`dcp_sharded`: decode context parallelism shards the group's token positions across W ranks, so one
allocator block spans block_size * W tokens (full attention); a replicated group (a Mamba state, a
sliding window every rank keeps whole) spans block_size tokens.
`tag` only distinguishes specs that look alike here (the vLLM drop-in puts vLLM's spec in it, so
groups batch together exactly when vLLM's would).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _check_positive(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def _check_non_negative(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{owner}.{name} must be a non-negative int, got {value!r}")


@dataclass(slots=True, frozen=True)
class FullAttentionSpec:
    block_size: int
    dcp_sharded: bool = field(default=True, kw_only=True)
    tag: object = field(default=None, kw_only=True)

    prefix_cacheable = True

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, "block_size", self.block_size)


@dataclass(slots=True, frozen=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding window: prompt tokens stay visible; of the generated ones only the last
    `rswa_window` are kept (the gap between them is freed)."""

    rswa_window: int = 0

    def __post_init__(self) -> None:
        _check_positive("RSWASpec", "block_size", self.block_size)
        _check_positive("RSWASpec", "rswa_window", self.rswa_window)


@dataclass(slots=True, frozen=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with `sink_len` attention-sink tokens (a multiple of the block size)."""

    sink_len: int = 0

    def __post_init__(self) -> None:
        _check_positive("SinkFullAttentionSpec", "block_size", self.block_size)
        _check_positive("SinkFullAttentionSpec", "sink_len", self.sink_len)


@dataclass(slots=True, frozen=True)
class SlidingWindowSpec:
    """The token at position p attends to positions (p - sliding_window, p]; `extra_retained_tokens`
    more below the window stay allocated (never attended) for multi-token-prediction replays."""

    block_size: int
    sliding_window: int
    extra_retained_tokens: int = 0
    dcp_sharded: bool = field(default=True, kw_only=True)
    tag: object = field(default=None, kw_only=True)
    # vLLM's bounded replay: a hit's last window is recomputed, so the group's blocks are never cached.
    bounded_replay: bool = field(default=False, kw_only=True)

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay

    def __post_init__(self) -> None:
        _check_positive("SlidingWindowSpec", "block_size", self.block_size)
        _check_positive("SlidingWindowSpec", "sliding_window", self.sliding_window)
        _check_non_negative("SlidingWindowSpec", "extra_retained_tokens", self.extra_retained_tokens)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Blocks one request can hold at once (window + in-flight tokens, one more for a window
        that starts inside a block): the full-sequence admission gate's cap."""
        num_tokens = min(self.sliding_window - 1 + self.extra_retained_tokens + max_in_flight_tokens, max_model_len)
        return -(-num_tokens // self.block_size) + 1


@dataclass(slots=True, frozen=True)
class ChunkedLocalAttentionSpec:
    """Tokens attend only within their chunk of `attention_chunk_size` positions."""

    block_size: int
    attention_chunk_size: int
    dcp_sharded: bool = field(default=True, kw_only=True)
    tag: object = field(default=None, kw_only=True)

    prefix_cacheable = True

    def __post_init__(self) -> None:
        _check_positive("ChunkedLocalAttentionSpec", "block_size", self.block_size)
        _check_positive("ChunkedLocalAttentionSpec", "attention_chunk_size", self.attention_chunk_size)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return -(-num_tokens // self.block_size)


@dataclass(slots=True, frozen=True)
class MambaSpec:
    """A recurrent state per block. "align" mode (prefix caching): the state after block i sits in
    block i, a hit keeps only the last one; `num_speculative_blocks` scratch states for speculative
    decoding; `num_prefill_checkpoint_blocks` > 0 reserves a block for an interior prefill
    checkpoint every `prefill_checkpoint_alignment` tokens."""

    block_size: int
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    dcp_sharded: bool = field(default=False, kw_only=True)
    tag: object = field(default=None, kw_only=True)

    prefix_cacheable = True

    def __post_init__(self) -> None:
        _check_positive("MambaSpec", "block_size", self.block_size)
        if self.mamba_cache_mode not in ("align", "none", "all"):
            raise ValueError(f"MambaSpec.mamba_cache_mode must be 'align', 'none' or 'all', "
                             f"got {self.mamba_cache_mode!r}")
        _check_non_negative("MambaSpec", "num_speculative_blocks", self.num_speculative_blocks)
        _check_non_negative("MambaSpec", "num_prefill_checkpoint_blocks", self.num_prefill_checkpoint_blocks)


@dataclass(slots=True, frozen=True)
class CircularBufferSpec:
    """One block per request for its whole life (a ring of raw keys); never prefix cached."""

    block_size: int
    dcp_sharded: bool = field(default=True, kw_only=True)
    tag: object = field(default=None, kw_only=True)

    prefix_cacheable = False

    def __post_init__(self) -> None:
        _check_positive("CircularBufferSpec", "block_size", self.block_size)


@dataclass(slots=True, frozen=True)
class CrossAttentionSpec:
    """Encoder-decoder cross attention: a static allocation for the encoder tokens, never cached."""

    block_size: int
    dcp_sharded: bool = field(default=True, kw_only=True)
    tag: object = field(default=None, kw_only=True)

    prefix_cacheable = True

    def __post_init__(self) -> None:
        _check_positive("CrossAttentionSpec", "block_size", self.block_size)


KVCacheSpec = (FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | MambaSpec | CircularBufferSpec
               | CrossAttentionSpec)
SPEC_TYPES = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec, CircularBufferSpec,
              CrossAttentionSpec)


@dataclass(slots=True)
class KVCacheConfig:
    """`num_blocks` includes the null block; every group allocates from the same pool.

    Args:
        eagle_group_ids: groups an EAGLE/MTP drafter reads (their hits drop the last block).
        prefix_cache_retention_interval: sparse retention of sliding-window and Mamba checkpoints
            (None: dense; 0: only replay boundaries; > 0: one per that many tokens).
        kv_cache_zeroing: whether new blocks are zeroed by the workers (None: when there is a Mamba
            group, whose state is read before it is written).
    """

    num_blocks: int
    groups: list[KVCacheSpec] = field(default_factory=list)
    eagle_group_ids: tuple[int, ...] = ()
    prefix_cache_retention_interval: int | None = None
    kv_cache_zeroing: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or isinstance(self.num_blocks, bool) or self.num_blocks < 2:
            raise ValueError(f"KVCacheConfig.num_blocks must be an int >= 2 (null block + 1), got {self.num_blocks!r}")
        if not self.groups:
            raise ValueError("KVCacheConfig.groups must hold at least one spec")
        for i, spec in enumerate(self.groups):
            if not isinstance(spec, SPEC_TYPES):
                raise ValueError(f"KVCacheConfig.groups[{i}] is not a KV-cache spec: {spec!r}")
        for g in self.eagle_group_ids:
            if not isinstance(g, int) or not 0 <= g < len(self.groups):
                raise ValueError(f"KVCacheConfig.eagle_group_ids names group {g!r}, not one of the "
                                 f"{len(self.groups)} groups")

    @property
    def has_mamba_layers(self) -> bool:
        return any(isinstance(s, MambaSpec) for s in self.groups)

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        return self.has_mamba_layers if self.kv_cache_zeroing is None else self.kv_cache_zeroing


def effective_block_size(spec: KVCacheSpec, dcp_world_size: int = 1) -> int:
    """Tokens one allocator block spans: DCP shards full-attention blocks across W ranks; a replicated
    group (`dcp_sharded=False`: Mamba, or a sliding window every rank keeps whole, as vLLM 0.33 lays
    windows out under DCP) spans its block size. Other sharded groups do not support DCP."""
    if not spec.dcp_sharded or dcp_world_size == 1:
        return spec.block_size
    if not isinstance(spec, FullAttentionSpec):
        raise ValueError(f"{type(spec).__name__} does not support decode context parallelism sharding its "
                         f"tokens (dcp_world_size={dcp_world_size}); only full attention is sharded, give other "
                         f"groups dcp_sharded=False (replicated on every rank)")
    return spec.block_size * dcp_world_size


def spec_kind(spec: KVCacheSpec) -> tuple[str, int | None]:
    """(vLLM's KVCacheSpecKind value, sliding window or None): what BlockStored events carry."""
    if isinstance(spec, SinkFullAttentionSpec):
        kind = "sink_full_attention"
    elif isinstance(spec, FullAttentionSpec):
        kind = "full_attention"
    elif isinstance(spec, SlidingWindowSpec):
        kind = "sliding_window"
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        kind = "chunked_local_attention"
    elif isinstance(spec, MambaSpec):
        kind = "mamba"
    elif isinstance(spec, CrossAttentionSpec):
        kind = "cross_attention"
    else:
        kind = "unknown"
    return kind, spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def gcd_block_size(config: KVCacheConfig, dcp_world_size: int = 1) -> int:
    cacheable = [effective_block_size(s, dcp_world_size) for s in config.groups if s.prefix_cacheable]
    return math.gcd(*(cacheable or [effective_block_size(s, dcp_world_size) for s in config.groups]))


def lcm_block_size(config: KVCacheConfig, dcp_world_size: int = 1) -> int:
    return math.lcm(*(effective_block_size(s, dcp_world_size) for s in config.groups))
