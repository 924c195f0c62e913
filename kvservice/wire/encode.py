"""Client side: domain records -> the protobuf requests the server decodes (`kvservice.wire.decode`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvservice._proto import allocator_pb2 as pb
from kvservice.commands import VllmOptions
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
from kvservice.hashing import HashSpec
from kvservice.ops import (
    AddRequestOp,
    AdmitBatchOp,
    AllocateBatchOp,
    AllocateOp,
    DecodeBatchOp,
    EvictBlocksOp,
    ForkOp,
    FreeHeldBlocksOp,
    FreeOp,
    GetNewBlocksOp,
    NewStepOp,
    Op,
    PinOp,
    RemoveSkippedBlocksOp,
    ResetPrefixCacheOp,
    TakeBlockCopiesOp,
    TouchBlocksOp,
    UnpinOp,
)
from kvservice.wire.fields import encode_u32


def encode_config(config: KVCacheConfig, max_model_len: int, dcp_world_size: int = 1, enable_caching: bool = True,
                  vocab_size: int = 0, kv_layout: str = "") -> pb.KVCacheConfig:
    msg = pb.KVCacheConfig(num_blocks=config.num_blocks, max_model_len=max_model_len, dcp_world_size=dcp_world_size,
                           disable_prefix_caching=not enable_caching, vocab_size=vocab_size, kv_layout=kv_layout)
    if config.prefix_cache_retention_interval is not None:
        msg.prefix_cache_retention_interval = config.prefix_cache_retention_interval
        msg.has_prefix_cache_retention_interval = True
    for spec in config.groups:
        g = msg.groups.add()
        if isinstance(spec, RSWASpec):  # (full attention's subclasses first)
            g.rswa.block_size = spec.block_size
            g.rswa.rswa_window = spec.rswa_window
        elif isinstance(spec, SinkFullAttentionSpec):
            g.sink_full_attention.block_size = spec.block_size
            g.sink_full_attention.sink_len = spec.sink_len
        elif isinstance(spec, FullAttentionSpec):
            g.full_attention.block_size = spec.block_size
        elif isinstance(spec, SlidingWindowSpec):
            if dcp_world_size > 1 and spec.dcp_sharded:
                raise ValueError(f"groups[{len(msg.groups) - 1}]: a sliding window under dcp_world_size "
                                 f"{dcp_world_size} is replicated on every rank (the allocator shards full "
                                 f"attention only); build it with SlidingWindowSpec(..., dcp_sharded=False)")
            g.sliding_window.block_size = spec.block_size
            g.sliding_window.sliding_window = spec.sliding_window
            g.sliding_window.extra_retained_tokens = spec.extra_retained_tokens
            g.sliding_window.bounded_replay = spec.bounded_replay
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            g.chunked_local.block_size = spec.block_size
            g.chunked_local.attention_chunk_size = spec.attention_chunk_size
        elif isinstance(spec, CrossAttentionSpec):
            g.cross_attention.block_size = spec.block_size
        elif isinstance(spec, CircularBufferSpec):
            g.circular_buffer.block_size = spec.block_size
        elif isinstance(spec, MambaSpec):
            g.mamba.block_size = spec.block_size
            g.mamba.num_speculative_blocks = spec.num_speculative_blocks
            g.mamba.num_prefill_checkpoint_blocks = spec.num_prefill_checkpoint_blocks
            g.mamba.prefill_checkpoint_alignment = spec.prefill_checkpoint_alignment or 0
            if spec.mamba_cache_mode != "align":
                g.mamba.mamba_cache_mode = spec.mamba_cache_mode
        else:
            raise ValueError(f"groups[{len(msg.groups) - 1}]: the allocator carries no {type(spec).__name__} groups")
        # (Sliding windows and Mamba are replicated under DCP by their kind; the rest say so.)
        if not spec.dcp_sharded and not isinstance(spec, (SlidingWindowSpec, MambaSpec)):
            g.replicated = True
    msg.eagle_group_ids.extend(config.eagle_group_ids)
    return msg


def encode_op(op: Op, msg: pb.Op) -> None:
    """Fills `msg` from a domain op."""
    if isinstance(op, AllocateOp):
        encode_allocate(op, msg.allocate)
    elif isinstance(op, AddRequestOp):
        encode_add(op, msg.add)
    elif isinstance(op, AllocateBatchOp):
        b = msg.allocate_batch
        b.request_ids.extend(op.request_ids)
        b.rows = encode_u32(op.rows)
        if op.append_block_hashes:
            b.append_block_hashes = b"".join(op.append_block_hashes)
    elif isinstance(op, DecodeBatchOp):
        d = msg.decode
        d.request_ids.extend(op.request_ids)
        d.num_computed_tokens = encode_u32(op.num_computed_tokens)
        if op.append_token_ids is not None:
            d.append_token_ids = encode_u32(op.append_token_ids)
        d.num_new_tokens = op.num_new_tokens
        d.num_lookahead_tokens = op.num_lookahead_tokens
    elif isinstance(op, AdmitBatchOp):
        a = msg.admit
        a.request_ids.extend(op.request_ids)
        a.token_ids = b"".join(encode_u32(p) for p in op.prompts)
        a.num_prompt_tokens = encode_u32([len(p) for p in op.prompts])
        if op.num_new_tokens is not None:
            a.num_new_tokens = encode_u32(op.num_new_tokens)
        a.num_lookahead_tokens = op.num_lookahead_tokens
        if op.cache_salts is not None:
            a.cache_salts.extend(s or "" for s in op.cache_salts)
        if op.lora_names is not None:
            a.lora_names.extend(name or "" for name in op.lora_names)
    elif isinstance(op, FreeOp):
        msg.free.request_id = op.request_id
        msg.free.popped = op.popped
    elif isinstance(op, EvictBlocksOp):
        msg.evict_blocks.block_ids.extend(op.block_ids)
    elif isinstance(op, NewStepOp):
        msg.new_step.SetInParent()
    elif isinstance(op, TakeBlockCopiesOp):
        msg.take_block_copies.SetInParent()
        msg.take_block_copies.block_ids.extend(op.block_ids)
    elif isinstance(op, GetNewBlocksOp):
        msg.get_new_blocks.num_blocks = op.num_blocks
    elif isinstance(op, FreeHeldBlocksOp):
        msg.free_held_blocks.block_ids.extend(op.block_ids)
    elif isinstance(op, TouchBlocksOp):
        msg.touch_blocks.block_ids.extend(op.block_ids)
    elif isinstance(op, RemoveSkippedBlocksOp):
        r = msg.remove_skipped_blocks
        r.request_id, r.processed_computed_tokens = op.request_id, op.processed_computed_tokens
    elif isinstance(op, PinOp):
        p = msg.pin
        p.pin_id = op.pin_id
        if op.block_hashes is not None:
            p.block_hashes, p.num_tokens = b"".join(op.block_hashes), op.num_tokens
        else:
            p.token_ids = encode_u32(op.token_ids or [])
        p.cache_salt, p.lora_name = op.cache_salt or "", op.lora_name or ""
    elif isinstance(op, UnpinOp):
        msg.unpin.pin_id = op.pin_id
    elif isinstance(op, ForkOp):
        msg.fork.parent_request_id = op.parent_request_id
        msg.fork.child_request_id = op.child_request_id
    elif isinstance(op, ResetPrefixCacheOp):
        msg.reset_prefix_cache.SetInParent()
    else:
        raise TypeError(f"not an op: {op!r}")


def encode_allocate(op: AllocateOp, a: pb.AllocateOp) -> None:
    a.request_id = op.request_id
    a.num_computed_tokens = op.num_computed_tokens
    a.num_new_tokens = op.num_new_tokens
    if op.append_token_ids is not None:
        a.append_token_ids = encode_u32(op.append_token_ids)
    if op.append_block_hashes is not None:
        a.append_block_hashes = b"".join(op.append_block_hashes)
    a.num_append_tokens = op.num_append_tokens
    a.num_lookahead_tokens = op.num_lookahead_tokens
    a.delay_cache_blocks = op.delay_cache_blocks
    a.allow_transfer = op.allow_transfer
    if op.external_source is not None:
        e = op.external_source
        a.external_source.CopyFrom(pb.ExternalSource(pin_id=e.pin_id, src_pool_id=e.src_pool_id,
                                                     src_block_ids=e.src_block_ids, num_tokens=e.num_tokens))
    if op.vllm_fields:  # zeros left unset (proto3: the same bytes)
        a.num_output_placeholders, a.num_in_flight_tokens, a.waiting = (op.num_output_placeholders,
                                                                        op.num_in_flight_tokens, op.waiting)
        a.lookup, a.num_new_computed_tokens = op.lookup, op.num_new_computed_tokens
        a.full_sequence_must_fit, a.reserved_blocks = op.full_sequence_must_fit, op.reserved_blocks
        a.has_scheduled_reqs, a.cache_tokens = op.has_scheduled_reqs, op.cache_tokens
        a.num_external_computed_tokens, a.num_encoder_tokens = op.num_external_computed_tokens, op.num_encoder_tokens
        a.max_cache_hit_length, a.connector_lookup = op.max_cache_hit_length, op.connector_lookup
        if op.shared_prefix_boundary is not None:
            a.shared_prefix_boundary = op.shared_prefix_boundary


def encode_add(op: AddRequestOp, a: pb.AddRequestOp) -> None:
    a.request_id = op.request_id
    if op.block_hashes is not None:
        a.block_hashes = b"".join(op.block_hashes)
        a.num_tokens = op.num_tokens
        a.num_prompt_tokens = op.num_prompt_tokens
    else:
        a.token_ids = encode_u32(op.token_ids or [])
    a.cache_salt = op.cache_salt or ""
    a.lora_name = op.lora_name or ""
    for m in op.mm_items:
        a.mm_items.add(identifier=m.identifier, offset=m.offset, length=m.length)


# ---- requests ------------------------------------------------------------------------------------
def encode_hash_spec(spec: HashSpec) -> pb.HashSpec:
    return pb.HashSpec(algorithm=spec.algorithm, seed=spec.seed or "", has_seed=spec.seed is not None)


def encode_vllm_options(options: VllmOptions) -> pb.VllmManagerOptions:
    return pb.VllmManagerOptions(watermark=options.watermark, scheduler_block_size=options.scheduler_block_size,
                                 max_in_flight_tokens=options.max_in_flight_tokens, use_eagle=options.use_eagle,
                                 num_hash_lookahead_tokens=options.num_hash_lookahead_tokens,
                                 num_prefill_lookahead=options.num_prefill_lookahead,
                                 mamba_recache_keyed_tails=options.mamba_recache_keyed_tails,
                                 mamba_shared_prefix_checkpoint=options.mamba_shared_prefix_checkpoint)


def register_request(pool_id: str, config: KVCacheConfig, max_model_len: int, epoch: int, dcp_world_size: int,
                     enable_caching: bool, vocab_size: int, kv_layout: str, fingerprint: str,
                     hash_spec: HashSpec | None = None, vllm: VllmOptions | None = None,
                     bound_to_session: bool = False, suspend_on_session_end: bool = False,
                     endpoint: bytes = b"") -> pb.RegisterPoolRequest:
    msg = pb.RegisterPoolRequest(pool_id=pool_id, epoch=epoch, hash_fingerprint=fingerprint,
                                 bound_to_session=bound_to_session, suspend_on_session_end=suspend_on_session_end,
                                 endpoint=endpoint,
                                 config=encode_config(config, max_model_len, dcp_world_size, enable_caching,
                                                      vocab_size, kv_layout))
    if hash_spec is not None:
        msg.hash_spec.CopyFrom(encode_hash_spec(hash_spec))
    if vllm is not None:
        msg.vllm.CopyFrom(encode_vllm_options(vllm))
    return msg


def step_request(pool_id: str, ops: Sequence[Op]) -> pb.StepRequest:
    msg = pb.StepRequest(pool_id=pool_id)
    add = msg.ops.add
    for op in ops:
        encode_op(op, add())
    return msg


def allocate_request(pool_id: str, op: AllocateOp, add: AddRequestOp | None) -> pb.AllocateRequest:
    msg = pb.AllocateRequest(pool_id=pool_id)
    if add is not None:
        encode_add(add, msg.add)
    encode_allocate(op, msg.allocate)
    return msg


def lookup_request(token_ids, block_hashes, num_tokens: int, cache_salt: str | None, lora_name: str | None,
                   pool_ids: Sequence[str]) -> pb.LookupRequest:
    msg = pb.LookupRequest(cache_salt=cache_salt or "", lora_name=lora_name or "", pool_ids=list(pool_ids),
                           num_tokens=num_tokens)
    if block_hashes is not None:
        msg.block_hashes = b"".join(block_hashes)
        msg.hash_bytes = len(block_hashes[0]) if block_hashes else 0
    else:
        msg.token_ids = encode_u32(token_ids)
    return msg
