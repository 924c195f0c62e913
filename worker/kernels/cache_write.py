"""Cache write: scatter this step's K/V `[T, Hkv, D]` into the paged caches at their slots (−1 skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels._common import (
    FLOAT_DTYPES,
    cache_strides,
    cdiv,
    check_contiguous,
    check_kernel_device,
    check_last_dim_contiguous,
    check_same_dtype,
    check_tensor,
    interpreting,
    next_pow2,
)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    num_tokens,
    key_stride_t: tl.int64,
    key_stride_h: tl.int64,
    value_stride_t: tl.int64,
    value_stride_h: tl.int64,
    key_cache_stride_b: tl.int64,
    key_cache_stride_s: tl.int64,
    key_cache_stride_h: tl.int64,
    value_cache_stride_b: tl.int64,
    value_cache_stride_s: tl.int64,
    value_cache_stride_h: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    TILE: tl.constexpr,
):
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    col = tl.program_id(1) * TILE + tl.arange(0, TILE)
    head = col // HEAD_SIZE
    dim = col % HEAD_SIZE
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    mask = (slot >= 0)[:, None] & (col < NUM_KV_HEADS * HEAD_SIZE)[None, :]
    slot = tl.maximum(slot, 0)
    tok64 = tok.to(tl.int64)
    # slot * row stride passes 2**31 on large caches: every offset below is int64.
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    k = tl.load(key_ptr + tok64[:, None] * key_stride_t + (head * key_stride_h + dim)[None, :], mask=mask)
    k_dst = block * key_cache_stride_b + offset * key_cache_stride_s
    tl.store(key_cache_ptr + k_dst[:, None] + (head * key_cache_stride_h + dim)[None, :], k, mask=mask)

    v = tl.load(value_ptr + tok64[:, None] * value_stride_t + (head * value_stride_h + dim)[None, :], mask=mask)
    v_dst = block * value_cache_stride_b + offset * value_cache_stride_s
    tl.store(value_cache_ptr + v_dst[:, None] + (head * value_cache_stride_h + dim)[None, :], v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` `[T, Hkv, D]` into `key_cache`/`value_cache` `[num_blocks, block_size, Hkv, D]`.

    Token t goes to block `slot_mapping[t] // block_size`, offset `slot_mapping[t] % block_size`; tokens with
    a negative slot (another DCP rank's, or padding) are skipped. Caches are addressed by their strides.
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    device = check_kernel_device("key", key)
    num_tokens, num_kv_heads, head_size = key.shape
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES, shape=key.shape, device=device)
    check_same_dtype("value", value, "key", key)
    check_tensor("key_cache", key_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("key_cache", key_cache, shape=(None, None, num_kv_heads, head_size))
    check_tensor("value_cache", value_cache, ndim=4, dtypes=FLOAT_DTYPES, shape=key_cache.shape, device=device)
    check_same_dtype("key_cache", key_cache, "key", key)
    check_same_dtype("value_cache", value_cache, "key", key)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), shape=(num_tokens,), device=device)
    check_contiguous("slot_mapping", slot_mapping)
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return
    row = num_kv_heads * head_size
    if interpreting():
        # The interpreter pays per program, not per element: one program covers many tokens.
        tile = next_pow2(row)
        tokens = max(1, min(next_pow2(num_tokens), (1 << 16) // tile))
    else:
        tile = min(next_pow2(row), 1024)
        tokens = 1
    grid = (cdiv(num_tokens, tokens), cdiv(row, tile))
    reshape_and_cache_kernel[grid](
        key_ptr=key,
        value_ptr=value,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        slot_mapping_ptr=slot_mapping,
        num_tokens=num_tokens,
        key_stride_t=key.stride(0),
        key_stride_h=key.stride(1),
        value_stride_t=value.stride(0),
        value_stride_h=value.stride(1),
        **cache_strides(key_cache, value_cache),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=key_cache.shape[1],
        TOKENS=tokens,
        TILE=tile,
    )
