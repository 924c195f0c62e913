"""Copy whole cache blocks (src -> dst) in every layer: copy-on-write of shared tail blocks, transfers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from worker.kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    check_contiguous,
    check_kernel_device,
    check_tensor,
    interpreting,
    next_pow2,
)


@triton.jit
def copy_blocks_kernel(
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size], each block contiguous
    pairs_ptr,  # [num_pairs, 2] int64 (src, dst)
    num_pairs,
    cache_stride_b: tl.int64,
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_size
    PAIRS: tl.constexpr,  # pairs per program
    TILE: tl.constexpr,
):
    pair = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)
    pair_ok = pair < num_pairs
    src = tl.load(pairs_ptr + pair * 2, mask=pair_ok, other=0)
    dst = tl.load(pairs_ptr + pair * 2 + 1, mask=pair_ok, other=0)
    elem = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = pair_ok[:, None] & (elem < BLOCK_NUMEL)[None, :]
    # block id * block stride passes 2**31 on large caches.
    src_offs = src.to(tl.int64)[:, None] * cache_stride_b + elem[None, :]
    dst_offs = dst.to(tl.int64)[:, None] * cache_stride_b + elem[None, :]
    tl.store(cache_ptr + dst_offs, tl.load(cache_ptr + src_offs, mask=mask), mask=mask)


def copy_blocks(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], pairs: torch.Tensor
) -> None:
    """For every layer's key and value cache, copy block `src` onto block `dst` for each `(src, dst)` pair.

    Args:
        key_caches, value_caches: one `[num_blocks, block_size, Hkv, D]` cache per layer (blocks contiguous).
        pairs: int64 `[P, 2]`; destinations must be distinct and must not also be sources in the same call.
    """
    if len(key_caches) != len(value_caches):
        raise ValueError(f"key_caches has {len(key_caches)} layers but value_caches has {len(value_caches)}")
    caches = [(f"key_caches[{i}]", c) for i, c in enumerate(key_caches)]
    caches += [(f"value_caches[{i}]", c) for i, c in enumerate(value_caches)]
    if not caches:
        return
    first_name, first = caches[0]
    device = check_kernel_device(first_name, check_tensor(first_name, first, ndim=4, dtypes=FLOAT_DTYPES))
    check_tensor("pairs", pairs, ndim=2, dtypes=(torch.int64,), shape=(None, 2), device=device)
    check_contiguous("pairs", pairs)
    for name, cache in caches:
        check_tensor(name, cache, ndim=4, dtypes=FLOAT_DTYPES, device=device)
        if not cache[0].is_contiguous():
            raise ValueError(
                f"{name} must have contiguous blocks (strides {cache.stride()} for shape {tuple(cache.shape)})"
            )
    num_pairs = pairs.shape[0]
    if num_pairs == 0:
        return
    if device.type == "cpu":
        num_blocks = min(c.shape[0] for _, c in caches)
        bad = pairs[(pairs < 0).any(dim=1) | (pairs >= num_blocks).any(dim=1)]
        if bad.numel():
            raise ValueError(f"pairs holds block ids outside [0, {num_blocks}): {bad[:4].tolist()}")
    for _, cache in caches:
        block_numel = cache[0].numel()
        if interpreting():
            # The interpreter pays per program: one program copies every pair.
            tile = next_pow2(block_numel)
            pairs_per_program = max(1, min(next_pow2(num_pairs), (1 << 18) // tile))
        else:
            tile, pairs_per_program = min(next_pow2(block_numel), 4096), 1
        grid = (cdiv(num_pairs, pairs_per_program), cdiv(block_numel, tile))
        copy_blocks_kernel[grid](
            cache_ptr=cache,
            pairs_ptr=pairs,
            num_pairs=num_pairs,
            cache_stride_b=cache.stride(0),
            BLOCK_NUMEL=block_numel,
            PAIRS=pairs_per_program,
            TILE=tile,
        )
