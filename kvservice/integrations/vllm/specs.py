"""vLLM's KV-cache specs and config, as kvservice.core's: the semantic fields, the vLLM spec kept as the
core spec's `tag` (so groups batch together exactly when vLLM's equality says they would)."""

from __future__ import annotations

from vllm.v1 import kv_cache_interface as vi

from kvservice.core import specs as cs


def core_spec(spec) -> cs.KVCacheSpec:
    """kvservice.core's spec for a vLLM spec (a core spec passes through)."""
    if isinstance(spec, cs.SPEC_TYPES):
        return spec
    if isinstance(spec, vi.UniformTypeKVCacheSpecs):
        inner = next(iter(spec.kv_cache_specs.values()))
        return core_spec_like(inner, spec.block_size, spec.dcp_sharded, spec)
    return core_spec_like(spec, spec.block_size, spec.dcp_sharded, spec)


def core_spec_like(spec, block_size: int, dcp_sharded: bool, tag) -> cs.KVCacheSpec:
    common = dict(dcp_sharded=dcp_sharded, tag=tag)
    if isinstance(spec, vi.RSWASpec):
        return cs.RSWASpec(block_size, rswa_window=spec.rswa_window, **common)
    if isinstance(spec, vi.SinkFullAttentionSpec):
        return cs.SinkFullAttentionSpec(block_size, sink_len=spec.sink_len, **common)
    if isinstance(spec, vi.FullAttentionSpec):  # MLA and hidden-state caches too
        return cs.FullAttentionSpec(block_size, **common)
    if isinstance(spec, vi.SlidingWindowSpec):
        return cs.SlidingWindowSpec(block_size, spec.sliding_window, spec.extra_retained_tokens,
                                    bounded_replay=getattr(spec, "bounded_replay", False), **common)
    if isinstance(spec, vi.ChunkedLocalAttentionSpec):
        return cs.ChunkedLocalAttentionSpec(block_size, spec.attention_chunk_size, **common)
    if isinstance(spec, vi.MambaSpec):
        return cs.MambaSpec(block_size, spec.mamba_cache_mode, spec.num_speculative_blocks,
                            getattr(spec, "num_prefill_checkpoint_blocks", 0),  # (not in 0.32)
                            getattr(spec, "prefill_checkpoint_alignment", None), **common)
    if isinstance(spec, vi.CircularBufferSpec):
        return cs.CircularBufferSpec(block_size, **common)
    if isinstance(spec, vi.CrossAttentionSpec):
        return cs.CrossAttentionSpec(block_size, **common)
    raise NotImplementedError(f"kvservice's core has no manager for vLLM's {type(spec).__name__}")


def core_config(config) -> cs.KVCacheConfig:
    """kvservice.core's config for vLLM's `KVCacheConfig` (its groups in order)."""
    groups = config.kv_cache_groups
    return cs.KVCacheConfig(
        config.num_blocks, [core_spec(g.kv_cache_spec) for g in groups],
        eagle_group_ids=tuple(i for i, g in enumerate(groups) if g.is_eagle_group),
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        kv_cache_zeroing=config.needs_kv_cache_zeroing)


def event_metadata(config) -> tuple[tuple[str, int | None], ...]:
    """(spec kind, sliding window) per group, as vLLM's KVCacheManager annotates BlockStored."""
    return tuple((vi.get_kv_cache_spec_kind(g.kv_cache_spec).value,
                  vi.get_kv_cache_spec_sliding_window(g.kv_cache_spec)) for g in config.kv_cache_groups)
