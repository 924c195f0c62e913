"""Server side: RegisterPool's pool spec (its KV-cache config, hash spec and vLLM options) as it arrives ->
PoolSpec, every field validated (`InvalidArgument` naming it)."""

from __future__ import annotations

import math

from kvservice._proto import allocator_pb2 as pb
from kvservice.commands import PoolSpec, VllmOptions
from kvservice.core import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvservice.core.coordinator import validate_retention_interval
from kvservice.core.specs import effective_block_size
from kvservice.errors import InvalidArgument
from kvservice.hashing import HashSpec, vllm_spec
from kvservice.hashing.spec import KVSERVICE
from kvservice.wire.fields import check_count, check_id, check_name
from kvservice.wire.limits import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_DCP_WORLD_SIZE,
    MAX_ENDPOINT_BYTES,
    MAX_EPOCH,
    MAX_MODEL_LEN,
    MAX_SPECULATIVE_BLOCKS,
)


def decode_config(msg: pb.KVCacheConfig, field: str = "config") -> tuple[KVCacheConfig, int, int]:
    """Returns (KVCacheConfig, max_model_len, dcp_world_size)."""
    if msg.num_blocks < 2:
        raise InvalidArgument(f"{field}.num_blocks", msg.num_blocks, "must be >= 2 (the null block + 1)")
    check_count(f"{field}.num_blocks", msg.num_blocks, MAX_BLOCKS)
    if not msg.groups:
        raise InvalidArgument(f"{field}.groups", [], "needs at least one KV-cache group")
    if msg.max_model_len == 0:
        raise InvalidArgument(f"{field}.max_model_len", 0, "must be positive")
    check_count(f"{field}.max_model_len", msg.max_model_len, MAX_MODEL_LEN)
    dcp = msg.dcp_world_size or 1
    check_count(f"{field}.dcp_world_size", dcp, MAX_DCP_WORLD_SIZE)
    specs = []
    for i, group in enumerate(msg.groups):
        kind = group.WhichOneof("kind")
        g = f"{field}.groups[{i}]"
        if kind is None:
            raise InvalidArgument(g, "{}", "set one of full_attention, sliding_window, chunked_local, mamba, "
                                           "cross_attention, sink_full_attention, rswa, circular_buffer")
        sub = getattr(group, kind)
        sharded = not group.replicated  # (under DCP; sliding windows and Mamba are replicated by their kind)
        if sub.block_size == 0 or sub.block_size > MAX_BLOCK_SIZE:
            raise InvalidArgument(f"{g}.{kind}.block_size", sub.block_size, f"must be in [1, {MAX_BLOCK_SIZE}]")
        if kind == "full_attention":
            specs.append(FullAttentionSpec(sub.block_size, dcp_sharded=sharded))
        elif kind == "sliding_window":
            if sub.sliding_window == 0:
                raise InvalidArgument(f"{g}.sliding_window.sliding_window", 0, "must be positive")
            # Under DCP a window is replicated on every rank (vLLM's dcp_sharded=False): only full
            # attention is sharded.
            check_count(f"{g}.sliding_window.extra_retained_tokens", sub.extra_retained_tokens, MAX_MODEL_LEN)
            specs.append(SlidingWindowSpec(sub.block_size, sub.sliding_window, sub.extra_retained_tokens,
                                           dcp_sharded=dcp == 1, bounded_replay=sub.bounded_replay))
        elif kind == "chunked_local":
            if sub.attention_chunk_size == 0:
                raise InvalidArgument(f"{g}.chunked_local.attention_chunk_size", 0, "must be positive")
            specs.append(ChunkedLocalAttentionSpec(sub.block_size, sub.attention_chunk_size, dcp_sharded=sharded))
        elif kind == "cross_attention":
            specs.append(CrossAttentionSpec(sub.block_size, dcp_sharded=sharded))
        elif kind == "sink_full_attention":
            if sub.sink_len == 0 or sub.sink_len % sub.block_size or sub.sink_len > MAX_MODEL_LEN:
                raise InvalidArgument(f"{g}.sink_full_attention.sink_len", sub.sink_len,
                                      f"must be a positive multiple of the block size {sub.block_size}, at most "
                                      f"{MAX_MODEL_LEN}")
            specs.append(SinkFullAttentionSpec(sub.block_size, sink_len=sub.sink_len, dcp_sharded=sharded))
        elif kind == "rswa":
            if sub.rswa_window == 0:
                raise InvalidArgument(f"{g}.rswa.rswa_window", 0, "must be positive")
            check_count(f"{g}.rswa.rswa_window", sub.rswa_window, MAX_MODEL_LEN)
            specs.append(RSWASpec(sub.block_size, rswa_window=sub.rswa_window, dcp_sharded=sharded))
        elif kind == "circular_buffer":
            specs.append(CircularBufferSpec(sub.block_size, dcp_sharded=sharded))
        else:
            mode = sub.mamba_cache_mode or "align"
            if mode not in ("align", "none", "all"):
                raise InvalidArgument(f"{g}.mamba.mamba_cache_mode", sub.mamba_cache_mode,
                                      "must be 'align' (or empty), 'none' or 'all'")
            if mode != "align" and not msg.disable_prefix_caching:
                raise InvalidArgument(f"{g}.mamba.mamba_cache_mode", mode, "prefix caching needs 'align' (or set "
                                                                          "disable_prefix_caching)")
            check_count(f"{g}.mamba.num_speculative_blocks", sub.num_speculative_blocks, MAX_SPECULATIVE_BLOCKS)
            if sub.num_prefill_checkpoint_blocks > 1:
                raise InvalidArgument(f"{g}.mamba.num_prefill_checkpoint_blocks", sub.num_prefill_checkpoint_blocks,
                                      "must be 0 or 1 (vLLM reserves one checkpoint block)")
            if sub.prefill_checkpoint_alignment and not sub.num_prefill_checkpoint_blocks:
                raise InvalidArgument(f"{g}.mamba.prefill_checkpoint_alignment", sub.prefill_checkpoint_alignment,
                                      "needs num_prefill_checkpoint_blocks = 1")
            check_count(f"{g}.mamba.prefill_checkpoint_alignment", sub.prefill_checkpoint_alignment, MAX_MODEL_LEN)
            specs.append(MambaSpec(sub.block_size, mode, sub.num_speculative_blocks, sub.num_prefill_checkpoint_blocks,
                                   sub.prefill_checkpoint_alignment or None))
        if dcp > 1 and specs[-1].dcp_sharded and kind not in ("full_attention", "sink_full_attention", "rswa"):
            raise InvalidArgument(f"{g}.replicated", False, f"under decode context parallelism (dcp_world_size "
                                                            f"{dcp}) only full-attention groups are sharded, as in "
                                                            f"vLLM: a {kind} group must be replicated")
    retention = msg.prefix_cache_retention_interval if msg.has_prefix_cache_retention_interval else None
    eagle = tuple(msg.eagle_group_ids)
    bad = next((g for g in eagle if g >= len(specs)), None)
    if bad is not None or len(set(eagle)) != len(eagle):
        raise InvalidArgument(f"{field}.eagle_group_ids", list(eagle), f"must name distinct groups of the "
                                                                       f"{len(specs)} (0-based)")
    # (No block zeroing: the engine's workers zero new blocks, the pool would only record their ids.)
    config = KVCacheConfig(int(msg.num_blocks), specs, eagle_group_ids=eagle, prefix_cache_retention_interval=retention,
                           kv_cache_zeroing=False)
    return config, msg.max_model_len, dcp


def decode_pool_spec(msg: pb.RegisterPoolRequest, hash_block_size: int) -> PoolSpec:
    pool_id = check_id("pool_id", msg.pool_id)
    endpoint = msg.endpoint  # bind once: each protobuf field access copies the bytes
    if len(endpoint) > MAX_ENDPOINT_BYTES:
        raise InvalidArgument("endpoint", len(endpoint), f"its length in bytes exceeds the limit of "
                                                         f"{MAX_ENDPOINT_BYTES} (a NIXL agent's metadata is a few KiB)")
    if msg.epoch > MAX_EPOCH:
        raise InvalidArgument("epoch", msg.epoch, f"exceeds the limit {MAX_EPOCH}; count engine restarts from 0")
    config, max_model_len, dcp = decode_config(msg.config)
    for i, spec in enumerate(config.groups):
        size = effective_block_size(spec, dcp)
        if size % hash_block_size:
            raise InvalidArgument(f"config.groups[{i}].block_size", spec.block_size,
                                  f"the block ({size} tokens) must be a multiple of the service's hash block "
                                  f"size {hash_block_size}")
    hash_spec = decode_hash_spec(msg.hash_spec, hash_block_size) if msg.HasField("hash_spec") else None
    vllm = decode_vllm_options(msg.vllm, config) if msg.HasField("vllm") else None
    if vllm is not None and vllm.num_prefill_lookahead and not msg.config.disable_prefix_caching \
            and (config.eagle_group_ids or vllm.use_eagle):
        size = vllm.scheduler_block_size or math.lcm(*(s.block_size for s in config.groups))
        if size < vllm.num_prefill_lookahead:  # (as vLLM's coordinator refuses it)
            raise InvalidArgument("vllm.num_prefill_lookahead", vllm.num_prefill_lookahead,
                                  f"multi-module MTP with prefix caching needs it at most the scheduler block size "
                                  f"{size}")
    retention = config.prefix_cache_retention_interval
    try:  # the pool's coordinator checks the same, at the scheduler's block size
        validate_retention_interval(retention, (vllm and vllm.scheduler_block_size) or math.lcm(
            *(s.block_size for s in config.groups)), config)
    except ValueError as exc:
        raise InvalidArgument("config.prefix_cache_retention_interval", retention, str(exc)) from None
    return PoolSpec(pool_id, config, max_model_len, dcp, not msg.config.disable_prefix_caching,
                    msg.config.vocab_size, check_name("config.kv_layout", msg.config.kv_layout) or "", msg.epoch,
                    hash_spec, vllm, msg.bound_to_session, msg.suspend_on_session_end, endpoint)


def decode_vllm_options(msg: pb.VllmManagerOptions, config: KVCacheConfig, field: str = "vllm") -> VllmOptions:
    if not 0.0 <= msg.watermark < 1.0:
        raise InvalidArgument(f"{field}.watermark", msg.watermark, "must be in [0, 1) (vLLM's scheduler watermark)")
    size = msg.scheduler_block_size
    if size:
        bad = [s.block_size for s in config.groups if size % s.block_size]
        if size > MAX_BLOCK_SIZE * len(config.groups) or bad:
            sizes = [s.block_size for s in config.groups]
            raise InvalidArgument(f"{field}.scheduler_block_size", size,
                                  f"must be a multiple of every group's block size {sizes}")
    check_count(f"{field}.max_in_flight_tokens", msg.max_in_flight_tokens, MAX_MODEL_LEN)
    check_count(f"{field}.num_hash_lookahead_tokens", msg.num_hash_lookahead_tokens, MAX_MODEL_LEN)
    check_count(f"{field}.num_prefill_lookahead", msg.num_prefill_lookahead, MAX_MODEL_LEN)
    for name in ("mamba_recache_keyed_tails", "mamba_shared_prefix_checkpoint"):
        if getattr(msg, name) and not config.has_mamba_layers:
            raise InvalidArgument(f"{field}.{name}", True, "only a pool with a Mamba group takes it")
    return VllmOptions(msg.watermark, size, msg.max_in_flight_tokens, msg.use_eagle, msg.num_hash_lookahead_tokens,
                       msg.num_prefill_lookahead, msg.mamba_recache_keyed_tails, msg.mamba_shared_prefix_checkpoint)


def decode_hash_spec(msg: pb.HashSpec, hash_block_size: int, field: str = "hash_spec") -> HashSpec:
    """A declared hash spec, at the allocator's hash block size."""
    algorithm = msg.algorithm or KVSERVICE
    if algorithm != KVSERVICE and algorithm not in vllm_spec.ALGORITHMS:
        raise InvalidArgument(f"{field}.algorithm", msg.algorithm,
                              f"must be {KVSERVICE!r} or one of vLLM's {', '.join(vllm_spec.ALGORITHMS)}")
    if msg.has_seed:
        check_name(f"{field}.seed", msg.seed)
    elif msg.seed:
        raise InvalidArgument(f"{field}.seed", msg.seed, "set has_seed with a seed (unset: the algorithm's default)")
    return HashSpec(algorithm, msg.seed if msg.has_seed else None, hash_block_size)
