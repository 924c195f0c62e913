"""Paged attention over a varlen batch (prefill with context and decode in one launch), GQA, DCP shards.

One program per (query block of one sequence, KV head): the tile packs the whole GQA group of query heads,
so every K/V tile read from the cache serves all of them. Online softmax in fp32 (base-2 internally).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels._common import (
    FLOAT_DTYPES,
    cache_strides,
    check_contiguous,
    check_dcp,
    check_kernel_device,
    check_last_dim_contiguous,
    check_query_start_loc_on_host,
    check_same_dtype,
    check_tensor,
    interpreting,
    next_pow2,
)
from worker.kernels.dcp import dcp_global_pos, dcp_local_len, dcp_local_seq_lens

_LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N) forced on any device; tests set it to run the GPU's small tiles (many query blocks,
# many key tiles, online-softmax rescaling) under the interpreter.
TILE_OVERRIDE: tuple[int, int] | None = None


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [>= num_seqs, max_num_blocks_per_req] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32, global length (context + new tokens)
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    lse_ptr,  # [num_tokens, num_q_heads] float32, written only when RETURN_LSE
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    sliding_window,
    dcp_rank,
    q_stride_t: tl.int64,
    q_stride_h: tl.int64,
    out_stride_t: tl.int64,
    out_stride_h: tl.int64,
    lse_stride_t: tl.int64,
    key_cache_stride_b: tl.int64,
    key_cache_stride_s: tl.int64,
    key_cache_stride_h: tl.int64,
    value_cache_stride_b: tl.int64,
    value_cache_stride_s: tl.int64,
    value_cache_stride_h: tl.int64,
    block_table_stride: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE
    BLOCK_SIZE: tl.constexpr,  # per-rank cache block size
    BLOCK_M: tl.constexpr,  # tile rows = BLOCK_Q query tokens x NUM_QUERIES_PER_KV heads
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per iteration
    SEQS_PAD: tl.constexpr,  # power of two > num_seqs
    USE_WINDOW: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    DCP_WORLD_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 tl.dot: exact for fp32 inputs; always on the interpreter (its bf16 dot is broken)
):
    # Index math is int64 throughout: offsets pass 2**31 on large caches, and the interpreter adds an
    # overflow check to every int32 add/mul, which would dominate its run time.
    q_block = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)

    # Sequence s owns query blocks [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1): a vectorised
    # count instead of a binary search, because the interpreter pays per scalar step.
    seq_idx = tl.arange(0, SEQS_PAD).to(tl.int64)
    is_seq = seq_idx < num_seqs
    starts = tl.load(query_start_loc_ptr + seq_idx, mask=is_seq, other=0).to(tl.int64)
    owns = is_seq & (starts // BLOCK_Q + seq_idx <= q_block)
    seq = tl.sum(owns.to(tl.int64), axis=0) - 1

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    q_block_in_seq = q_block - (q_start // BLOCK_Q + seq)
    if q_block_in_seq * BLOCK_Q < q_len:
        context_len = tl.load(seq_lens_ptr + seq).to(tl.int64) - q_len

        rows = tl.arange(0, BLOCK_M).to(tl.int64)
        q_in_seq = q_block_in_seq * BLOCK_Q + rows // NUM_QUERIES_PER_KV
        head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
        row_ok = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_in_seq < q_len)
        # Padding rows get position -1: no key is visible to them.
        q_pos = tl.where(row_ok, context_len + q_in_seq, -1)[:, None]
        tok = q_start + q_in_seq
        dims = tl.arange(0, HEAD_PAD)
        if HEAD_PAD == HEAD_SIZE:
            q_mask = row_ok[:, None]
        else:
            q_mask = row_ok[:, None] & (dims < HEAD_SIZE)[None, :]
        q = tl.load(q_ptr + (tok * q_stride_t + head * q_stride_h)[:, None] + dims[None, :], mask=q_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32) * qk_scale

        # Local keys are stored in increasing global position, so the keys this block can see form one
        # contiguous local range [lo, hi), found with the per-rank length formula.
        first_pos = context_len + q_block_in_seq * BLOCK_Q
        last_pos = context_len + tl.minimum((q_block_in_seq + 1) * BLOCK_Q, q_len) - 1
        # (Without DCP the helpers are skipped: a device-function call costs the interpreter ~1 ms.)
        if DCP_WORLD_SIZE == 1:
            hi = last_pos + 1
        else:
            hi = dcp_local_len(last_pos + 1, DCP_WORLD_SIZE, dcp_rank, INTERLEAVE)
        lo = hi * 0
        if USE_WINDOW:
            lo_pos = tl.maximum(first_pos - sliding_window + 1, 0)
            if DCP_WORLD_SIZE == 1:
                lo = lo_pos
            else:
                lo = dcp_local_len(lo_pos, DCP_WORLD_SIZE, dcp_rank, INTERLEAVE)

        table_row = block_table_ptr + seq * block_table_stride
        k_base = key_cache_ptr + kv_head * key_cache_stride_h + dims[:, None]  # [HEAD_PAD, 1]
        v_base = value_cache_ptr + kv_head * value_cache_stride_h + dims[None, :]  # [1, HEAD_PAD]
        key_range = tl.arange(0, BLOCK_N).to(tl.int64)
        # A finite floor instead of -inf keeps exp2(m_old - m_new) and exp2(s - m_new) NaN-free for rows
        # that have seen no key yet; their l stays 0.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, tl.float32)
        for start in range(lo, hi, BLOCK_N):
            key_idx = start + key_range
            key_ok = key_idx < hi
            # A tile spans several cache blocks: one table lookup per key.
            block = tl.load(table_row + key_idx // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            offset = key_idx % BLOCK_SIZE
            # Keys past `hi` read block 0 (in bounds) and are never visible, so K needs no key mask; V does,
            # since 0 * garbage (NaN in a fresh cache) would poison the accumulator.
            k_offs = block * key_cache_stride_b + offset * key_cache_stride_s
            if HEAD_PAD == HEAD_SIZE:
                k = tl.load(k_base + k_offs[None, :])  # [HEAD_PAD, BLOCK_N]
            else:
                k = tl.load(k_base + k_offs[None, :], mask=(dims < HEAD_SIZE)[:, None], other=0.0)
            if DOT_FP32:
                scores = tl.dot(q, k.to(tl.float32), input_precision="ieee")
            else:
                scores = tl.dot(q, k) * qk_scale

            # Global positions grow with the local index, so every key at or past `hi` lies beyond the
            # block's last query and the causal test alone masks it.
            if DCP_WORLD_SIZE == 1:
                key_pos = key_idx[None, :]
            else:
                key_pos = dcp_global_pos(key_idx, BLOCK_SIZE, DCP_WORLD_SIZE, dcp_rank, INTERLEAVE)[None, :]
            if USE_WINDOW:
                visible = (key_pos <= q_pos) & (key_pos > q_pos - sliding_window)
            else:
                visible = key_pos <= q_pos
            scores = tl.where(visible, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.math.exp2(scores - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)

            v_offs = block * value_cache_stride_b + offset * value_cache_stride_s
            if HEAD_PAD == HEAD_SIZE:
                v = tl.load(v_base + v_offs[:, None], mask=key_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_PAD]
            else:
                v = tl.load(v_base + v_offs[:, None], mask=key_ok[:, None] & (dims < HEAD_SIZE)[None, :], other=0.0)
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        out_offs = (tok * out_stride_t + head * out_stride_h)[:, None] + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        if RETURN_LSE:
            # Back from base 2 to natural log: multiply by ln 2.
            lse_2 = m_i + tl.math.log2(tl.where(seen, l_i, 1.0))
            lse = tl.where(seen, lse_2 * 0.6931471805599453, float("-inf"))
            tl.store(lse_ptr + tok * lse_stride_t + head, lse, mask=row_ok)


def _tile_sizes(num_queries_per_kv: int, head_pad: int, max_query_len: int | None) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for this device.

    The interpreter pays per program and per loop iteration far more than per element, so it gets large
    tiles: many query rows for prefill (fewer programs), many keys for decode (fewer iterations). A GPU
    gets vLLM-like tiles that fit registers and shared memory.
    """
    group = next_pow2(num_queries_per_kv)
    if TILE_OVERRIDE is not None:
        return max(16, group, TILE_OVERRIDE[0]), TILE_OVERRIDE[1]
    if interpreting() and max_query_len is not None:
        block_m = min(128, max(16, group, next_pow2(num_queries_per_kv * max_query_len)))
        return max(block_m, group), (256 if block_m >= 128 else 512)
    return max(16, group), (64 if head_pad <= 128 else 32)


def _check_lengths_on_host(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, max_local_keys: int,
    local_lens: torch.Tensor,
) -> int:
    """Value checks that would need a device sync on a GPU; done only when the tensors live on the CPU.

    Returns the longest query length (the interpreter sizes its tiles with it).
    """
    qsl = check_query_start_loc_on_host(query_start_loc, num_tokens)
    q_lens = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
    short = [(i, s, n) for i, (s, n) in enumerate(zip(seq_lens.tolist(), q_lens, strict=True)) if s < n]
    if short:
        i, s, n = short[0]
        raise ValueError(
            f"seq_lens[{i}] = {s} is shorter than its {n} query tokens; seq_lens is the total length "
            "(context + new tokens)"
        )
    long = [(i, n) for i, n in enumerate(local_lens.tolist()) if n > max_local_keys]
    if long:
        i, n = long[0]
        raise ValueError(
            f"seq_lens[{i}] = {seq_lens[i].item()} needs {n} cached tokens on this rank, more than the "
            f"{max_local_keys} its block_table row can address (width x block_size)"
        )
    return max(q_lens, default=0)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    return_lse: bool = False,
    dcp_world_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each sequence's new tokens over its paged KV (this DCP rank's shard).

    Args:
        q: `[T, Hq, D]`; sequence i's queries are rows `query_start_loc[i]:query_start_loc[i+1]`, the last
            q_len positions of a sequence of global length `seq_lens[i]`.
        key_cache, value_cache: `[num_blocks, block_size, Hkv, D]`, Hq a multiple of Hkv.
        block_table: int32 `[>= R, max_num_blocks_per_req]`; local key j of sequence i sits at block
            `block_table[i, j // block_size]`, offset `j % block_size`.
        query_start_loc: int32 `[R + 1]`; seq_lens: int32 `[R]`.
        sliding_window: a query at position p sees keys at `(p - sliding_window, p]`; None: all `<= p`.
    Returns:
        out `[T, Hq, D]` in q's dtype, and with `return_lse` also lse `[T, Hq]` fp32 (natural log). Rows
        that see no key (and rows past `query_start_loc[-1]`) get out 0 and lse -inf.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = check_kernel_device("q", q)
    num_tokens, num_q_heads, head_size = q.shape
    check_tensor("key_cache", key_cache, ndim=4, dtypes=FLOAT_DTYPES, device=device)
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    check_tensor("key_cache", key_cache, shape=(None, None, None, head_size))
    check_tensor("value_cache", value_cache, ndim=4, dtypes=FLOAT_DTYPES, shape=key_cache.shape, device=device)
    check_same_dtype("key_cache", key_cache, "q", q)
    check_same_dtype("value_cache", value_cache, "q", q)
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, t)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has {num_q_heads} heads, not a multiple of the caches' {num_kv_heads} KV heads "
            "(GQA needs Hq % Hkv == 0)"
        )
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    check_contiguous("query_start_loc", query_start_loc)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must have num_seqs + 1 >= 1 entries, got 0")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), shape=(num_seqs,), device=device)
    check_contiguous("seq_lens", seq_lens)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=device)
    if block_table.shape[0] < num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, fewer than the {num_seqs} sequences")
    check_last_dim_contiguous("block_table", block_table)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise ValueError(f"scale must be a float, got {scale!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0
    ):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    check_dcp(dcp_world_size, dcp_rank, interleave, block_size)
    max_query_len = None
    if device.type == "cpu":
        local_lens = dcp_local_seq_lens(seq_lens, dcp_world_size, interleave, dcp_rank)
        max_local_keys = block_table.shape[1] * block_size
        max_query_len = _check_lengths_on_host(query_start_loc, seq_lens, num_tokens, max_local_keys, local_lens)

    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=device)
    if num_tokens > 0 and num_seqs > 0:
        qpk = num_q_heads // num_kv_heads
        head_pad = max(16, next_pow2(head_size))
        block_m, block_n = _tile_sizes(qpk, head_pad, max_query_len)
        block_q = block_m // qpk
        grid = (num_tokens // block_q + num_seqs, num_kv_heads)
        paged_attention_kernel[grid](
            q_ptr=q,
            key_cache_ptr=key_cache,
            value_cache_ptr=value_cache,
            block_table_ptr=block_table,
            query_start_loc_ptr=query_start_loc,
            seq_lens_ptr=seq_lens,
            out_ptr=out,
            lse_ptr=lse,
            qk_scale=float(scale) * _LOG2E,
            num_seqs=num_seqs,
            sliding_window=sliding_window or 0,
            dcp_rank=dcp_rank,
            q_stride_t=q.stride(0),
            q_stride_h=q.stride(1),
            out_stride_t=out.stride(0),
            out_stride_h=out.stride(1),
            lse_stride_t=lse.stride(0),
            **cache_strides(key_cache, value_cache),
            block_table_stride=block_table.stride(0),
            NUM_QUERIES_PER_KV=qpk,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            SEQS_PAD=next_pow2(num_seqs + 1),
            USE_WINDOW=sliding_window is not None,
            RETURN_LSE=return_lse,
            DCP_WORLD_SIZE=dcp_world_size,
            INTERLEAVE=interleave,
            DOT_FP32=q.dtype == torch.float32 or interpreting(),
        )
    return (out, lse) if return_lse else out
