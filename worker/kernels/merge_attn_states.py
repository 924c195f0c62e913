"""Merge partial attention (out, lse) computed by W DCP ranks over disjoint key shards, by log-sum-exp."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    check_kernel_device,
    check_last_dim_contiguous,
    check_tensor,
    interpreting,
    next_pow2,
)


@triton.jit
def merge_attn_states_kernel(
    outs_ptr,  # [num_parts, num_tokens, num_heads, head_size]
    lses_ptr,  # [num_parts, num_tokens, num_heads] float32
    out_ptr,  # [num_tokens, num_heads, head_size]
    lse_ptr,  # [num_tokens, num_heads] float32
    num_rows,  # num_tokens * num_heads
    outs_stride_w: tl.int64,
    outs_stride_t: tl.int64,
    outs_stride_h: tl.int64,
    lses_stride_w: tl.int64,
    lses_stride_t: tl.int64,
    lses_stride_h: tl.int64,
    NUM_PARTS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < num_rows
    tok = (row // NUM_HEADS).to(tl.int64)
    head = row % NUM_HEADS
    dims = tl.arange(0, HEAD_PAD)
    mask = row_ok[:, None] & (dims < HEAD_SIZE)[None, :]
    lse_offs = tok * lses_stride_t + head * lses_stride_h
    out_offs = tok[:, None] * outs_stride_t + head[:, None] * outs_stride_h + dims[None, :]

    m = tl.full([ROWS], float("-inf"), tl.float32)
    for w in tl.static_range(NUM_PARTS):
        part_lse = tl.load(lses_ptr + w * lses_stride_w + lse_offs, mask=row_ok, other=float("-inf"))
        # NaN and +inf mean "no valid result" (as in vLLM's merge): treat them as an empty shard.
        part_lse = tl.where((part_lse == part_lse) & (part_lse != float("inf")), part_lse, float("-inf"))
        m = tl.maximum(m, part_lse)
    m_shift = tl.where(m == float("-inf"), 0.0, m)

    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    for w in tl.static_range(NUM_PARTS):
        part_lse = tl.load(lses_ptr + w * lses_stride_w + lse_offs, mask=row_ok, other=float("-inf"))
        part_lse = tl.where((part_lse == part_lse) & (part_lse != float("inf")), part_lse, float("-inf"))
        weight = tl.exp(part_lse - m_shift)
        part = tl.load(outs_ptr + w * outs_stride_w + out_offs, mask=mask, other=0.0).to(tl.float32)
        # An empty shard's out may hold anything (even NaN): select, never multiply by its zero weight.
        acc += tl.where(weight[:, None] > 0.0, part * weight[:, None], 0.0)
        total += weight

    seen = total > 0.0
    merged = acc / tl.where(seen, total, 1.0)[:, None]
    dst = tok[:, None] * (NUM_HEADS * HEAD_SIZE) + head[:, None] * HEAD_SIZE + dims[None, :]
    tl.store(out_ptr + dst, merged.to(out_ptr.dtype.element_ty), mask=mask)
    lse = tl.where(seen, m_shift + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + tok * NUM_HEADS + head, lse, mask=row_ok)


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine W partial attentions over disjoint key sets into the attention over their union.

    Args:
        outs: `[W, T, H, D]` partial outputs (fp16/bf16/fp32); lses: `[W, T, H]` fp32 natural-log LSEs.
    Returns:
        out `[T, H, D]` (outs' dtype) and lse `[T, H]` fp32. A part with lse -inf contributes nothing;
        a row where every part is -inf gets out 0 and lse -inf.
    """
    check_tensor("outs", outs, ndim=4, dtypes=FLOAT_DTYPES)
    check_kernel_device("outs", outs)
    num_parts, num_tokens, num_heads, head_size = outs.shape
    check_tensor(
        "lses", lses, ndim=3, dtypes=(torch.float32,), shape=(num_parts, num_tokens, num_heads), device=outs.device
    )
    check_last_dim_contiguous("outs", outs)
    if num_parts == 0:
        raise ValueError("outs must hold at least one part (W >= 1), got W = 0")
    out = torch.empty((num_tokens, num_heads, head_size), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=outs.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out, lse
    head_pad = next_pow2(head_size)
    rows = max(1, (1 << 15 if interpreting() else 1 << 12) // head_pad)
    rows = min(rows, next_pow2(num_rows))
    merge_attn_states_kernel[(cdiv(num_rows, rows),)](
        outs_ptr=outs,
        lses_ptr=lses,
        out_ptr=out,
        lse_ptr=lse,
        num_rows=num_rows,
        outs_stride_w=outs.stride(0),
        outs_stride_t=outs.stride(1),
        outs_stride_h=outs.stride(2),
        lses_stride_w=lses.stride(0),
        lses_stride_t=lses.stride(1),
        lses_stride_h=lses.stride(2),
        NUM_PARTS=num_parts,
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        ROWS=rows,
    )
    return out, lse
