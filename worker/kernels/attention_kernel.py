"""The paged-attention Triton kernel (its launcher, `worker.kernels.paged_attention`, picks tiles and grid).

One program per (query block of one sequence, KV head, key segment): the tile packs the whole GQA group of
query heads, so every K/V tile read from the cache serves all of them. Online softmax in fp32 (base-2
internally). A block's visible keys are walked in three runs of tiles: tiles every row sees whole (no mask
at all), and before and after them the tiles cut by the sliding window's edge or the causal diagonal (or
past the last key), which are masked. Tiles past the diagonal are never visited. With SPLIT the walk is cut
into `num_segments` equal runs of tiles, one per program, each writing a partial result for
`split_kv.merge_segments_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from worker.kernels.dcp import dcp_global_pos, dcp_local_len


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
    partial_out_ptr,  # [num_tokens, num_q_heads, num_segments, head_size] float32, only with SPLIT
    partial_lse_ptr,  # [num_tokens, num_q_heads, num_segments] float32 base-2 LSE, only with SPLIT
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    sliding_window,
    dcp_rank,
    num_segments,
    q_stride_t: tl.int64,
    q_stride_h: tl.int64,
    out_stride_t: tl.int64,
    out_stride_h: tl.int64,
    lse_stride_t: tl.int64,
    partial_stride_t: tl.int64,  # of partial_lse; partial_out's row offsets are these times HEAD_SIZE
    partial_stride_h: tl.int64,
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
    SPLIT: tl.constexpr = False,  # write partials per segment (program_id(2)) instead of out / lse
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
        # Padding rows get position -1: no key of a masked tile is visible to them. (Unmasked tiles give
        # them scores of a zero query; they are never stored.)
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
        # contiguous local range [lo, hi), and those every row sees one range [full_lo, full_hi) inside it,
        # all found with the per-rank length formula.
        first_pos = context_len + q_block_in_seq * BLOCK_Q
        last_pos = context_len + tl.minimum((q_block_in_seq + 1) * BLOCK_Q, q_len) - 1
        # (Without DCP the helpers are skipped: a device-function call costs the interpreter ~1 ms.)
        if DCP_WORLD_SIZE == 1:
            hi = last_pos + 1
            full_hi = first_pos + 1
        else:
            hi = dcp_local_len(last_pos + 1, DCP_WORLD_SIZE, dcp_rank, INTERLEAVE)
            full_hi = dcp_local_len(first_pos + 1, DCP_WORLD_SIZE, dcp_rank, INTERLEAVE)
        lo = hi * 0
        full_lo = lo
        if USE_WINDOW:
            lo_pos = tl.maximum(first_pos - sliding_window + 1, 0)
            full_lo_pos = tl.maximum(last_pos - sliding_window + 1, 0)
            if DCP_WORLD_SIZE == 1:
                lo = lo_pos
                full_lo = full_lo_pos
            else:
                lo = dcp_local_len(lo_pos, DCP_WORLD_SIZE, dcp_rank, INTERLEAVE)
                full_lo = dcp_local_len(full_lo_pos, DCP_WORLD_SIZE, dcp_rank, INTERLEAVE)

        # Tiles start at lo + t * BLOCK_N; tiles [whole_lo, whole_hi) lie inside [full_lo, full_hi).
        num_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
        whole_lo = (full_lo - lo + BLOCK_N - 1) // BLOCK_N
        whole_hi = tl.maximum(whole_lo, (full_hi - lo) // BLOCK_N)
        if SPLIT:
            segment = tl.program_id(2).to(tl.int64)
            per_segment = (num_tiles + num_segments - 1) // num_segments
            tile_lo = tl.minimum(segment * per_segment, num_tiles)
            tile_hi = tl.minimum(tile_lo + per_segment, num_tiles)
        else:
            tile_lo = num_tiles * 0
            tile_hi = num_tiles

        table_row = block_table_ptr + seq * block_table_stride
        k_base = key_cache_ptr + kv_head * key_cache_stride_h + dims[:, None]  # [HEAD_PAD, 1]
        v_base = value_cache_ptr + kv_head * value_cache_stride_h + dims[None, :]  # [1, HEAD_PAD]
        key_range = tl.arange(0, BLOCK_N).to(tl.int64)
        # A finite floor instead of -inf keeps exp2(m_old - m_new) and exp2(s - m_new) NaN-free for rows
        # that have seen no key yet; their l stays 0.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, tl.float32)
        # Run 0: masked tiles before the whole ones (the window's edge); run 1: whole tiles; run 2: masked
        # tiles after them (the diagonal, the last partial tile). Each clipped to this segment's tiles.
        for run in tl.static_range(3):
            if run == 0:
                run_lo = tile_lo
                run_hi = tl.minimum(tile_hi, whole_lo)
            elif run == 1:
                run_lo = tl.maximum(tile_lo, whole_lo)
                run_hi = tl.minimum(tile_hi, whole_hi)
            else:
                run_lo = tl.maximum(tile_lo, whole_hi)
                run_hi = tile_hi
            for tile in range(run_lo, run_hi):
                key_idx = lo + tile * BLOCK_N + key_range
                # A tile spans several cache blocks: one table lookup per key. Keys past `hi` (masked runs
                # only) read block 0, in bounds.
                if run == 1:
                    block = tl.load(table_row + key_idx // BLOCK_SIZE).to(tl.int64)
                else:
                    key_ok = key_idx < hi
                    block = tl.load(table_row + key_idx // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
                offset = key_idx % BLOCK_SIZE
                k_offs = block * key_cache_stride_b + offset * key_cache_stride_s
                if HEAD_PAD == HEAD_SIZE:
                    k = tl.load(k_base + k_offs[None, :])  # [HEAD_PAD, BLOCK_N]
                else:
                    k = tl.load(k_base + k_offs[None, :], mask=(dims < HEAD_SIZE)[:, None], other=0.0)
                if DOT_FP32:
                    scores = tl.dot(q, k.to(tl.float32), input_precision="ieee")
                else:
                    scores = tl.dot(q, k) * qk_scale

                if run != 1:
                    # Global positions grow with the local index, so every key at or past `hi` lies beyond
                    # the block's last query and the causal test alone masks it.
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

                # V of keys past `hi` is masked: 0 * garbage (NaN in a fresh cache) would poison acc.
                v_offs = block * value_cache_stride_b + offset * value_cache_stride_s
                if run == 1:
                    v_mask = (dims < HEAD_SIZE)[None, :]
                else:
                    v_mask = key_ok[:, None] & (dims < HEAD_SIZE)[None, :]
                if run == 1 and HEAD_PAD == HEAD_SIZE:
                    v = tl.load(v_base + v_offs[:, None])  # [BLOCK_N, HEAD_PAD]
                else:
                    v = tl.load(v_base + v_offs[:, None], mask=v_mask, other=0.0)
                if DOT_FP32:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        # Base 2 here; the merge and the natural-log output multiply by ln 2.
        lse_2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        if SPLIT:
            part = tok * partial_stride_t + head * partial_stride_h + segment
            # An empty segment writes only its -inf LSE: the merge never reads its output. (The test is made
            # a vector first: the interpreter rejects a mask that mixes a scalar comparison in.)
            wrote = (row_ok & (tile_lo + rows * 0 < tile_hi))[:, None]
            if HEAD_PAD != HEAD_SIZE:
                wrote = wrote & (dims < HEAD_SIZE)[None, :]
            tl.store(partial_out_ptr + part[:, None] * HEAD_SIZE + dims[None, :], out, mask=wrote)
            tl.store(partial_lse_ptr + part, lse_2, mask=row_ok)
        else:
            out_offs = (tok * out_stride_t + head * out_stride_h)[:, None] + dims[None, :]
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
            if RETURN_LSE:
                tl.store(lse_ptr + tok * lse_stride_t + head, lse_2 * 0.6931471805599453, mask=row_ok)
