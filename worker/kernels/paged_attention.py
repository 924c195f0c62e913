"""Paged attention over a varlen batch (prefill with context and decode in one launch), GQA, DCP shards.

The launcher: argument checks, the launch configuration (interpreter tiles here, GPU tiles from
`attention_config`), and the split-KV decision (`split_kv`): with more than one key segment the kernel writes
partials to a preallocated workspace and `merge_segments` combines them. The kernel is in
`attention_kernel.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels._common import (
    FLOAT_DTYPES,
    cache_strides,
    cdiv,
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
from worker.kernels.attention_config import LaunchConfig, device_family, gpu_launch_config, num_sms
from worker.kernels.attention_kernel import paged_attention_kernel
from worker.kernels.dcp import dcp_local_seq_lens
from worker.kernels.split_kv import (
    TARGET_WAVES,
    SplitKVWorkspace,
    merge_segments,
    num_kv_segments,
    workspace_for,
)

__all__ = [
    "NUM_SEGMENTS_OVERRIDE",
    "TILE_OVERRIDE",
    "LaunchPlan",
    "launch_plan",
    "paged_attention",
    "paged_attention_kernel",
]

_LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N), or (BLOCK_M, BLOCK_N, num_warps, num_stages), forced on any device; tests set it to
# run the GPU's small tiles (many query blocks, many key tiles, online-softmax rescaling) under the
# interpreter, and the GPU benchmark's --tune to try configurations.
TILE_OVERRIDE: tuple[int, ...] | None = None

# Key segments per program forced on any device (1: never split); tests set it to run the split-KV path
# under the interpreter, where the SM-count heuristic never splits.
NUM_SEGMENTS_OVERRIDE: int | None = None


def _launch_config(
    num_queries_per_kv: int, head_pad: int, q: torch.Tensor, num_seqs: int, max_query_len: int | None
) -> LaunchConfig:
    """Tiles and schedule for this call.

    The interpreter pays per program and per loop iteration far more than per element, so it gets large
    tiles: many query rows for prefill (fewer programs), many keys for decode (fewer iterations). A GPU
    gets `attention_config.gpu_launch_config`: one GQA group's rows for decode, 64-128 rows for prefill.
    """
    group = next_pow2(num_queries_per_kv)
    if TILE_OVERRIDE is not None:
        block_m, block_n, *schedule = TILE_OVERRIDE
        return LaunchConfig(max(16, group, block_m), block_n, *schedule)
    if interpreting() and max_query_len is not None:
        block_m = min(128, max(16, group, next_pow2(num_queries_per_kv * max_query_len)))
        return LaunchConfig(max(block_m, group), 256 if block_m >= 128 else 512)
    if q.device.type != "cuda":
        return LaunchConfig(max(16, group), 64 if head_pad <= 128 else 32)
    avg_query_len = cdiv(q.shape[0], max(1, num_seqs))
    return gpu_launch_config(num_queries_per_kv, head_pad, q.dtype, avg_query_len, device_family(q.device.index))


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """What `paged_attention` launches: tiles and schedule, and key segments per program (1: unsplit)."""

    config: LaunchConfig
    num_segments: int


def launch_plan(
    q: torch.Tensor,
    num_kv_heads: int,
    num_seqs: int,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    dcp_world_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> LaunchPlan:
    """The plan `paged_attention` uses for these sizes, from host values only (no device sync).

    Segments: NUM_SEGMENTS_OVERRIDE, else `split_kv.num_kv_segments` on a GPU, else 1.
    """
    num_tokens, num_q_heads, head_size = q.shape
    qpk = num_q_heads // num_kv_heads
    config = _launch_config(qpk, max(16, next_pow2(head_size)), q, num_seqs, max_query_len)
    if NUM_SEGMENTS_OVERRIDE is not None:
        return LaunchPlan(config, NUM_SEGMENTS_OVERRIDE)
    if q.device.type != "cuda":
        return LaunchPlan(config, 1)
    block_q = config.block_m // qpk
    # Programs that have work: at least one query block per sequence, and one more every block_q tokens.
    working = max(num_seqs, cdiv(num_tokens, block_q)) * num_kv_heads
    max_key_tiles = None
    if max_seq_len is not None:
        keys = int(dcp_local_seq_lens(max_seq_len, dcp_world_size, interleave, dcp_rank))
        if sliding_window is not None:
            keys = min(keys, cdiv(sliding_window + block_q, dcp_world_size) + interleave)
        max_key_tiles = cdiv(keys, config.block_n)
    return LaunchPlan(config, num_kv_segments(working, num_sms(q.device.index), max_key_tiles))


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
    max_seq_len: int | None = None,
    workspace: SplitKVWorkspace | None = None,
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
        max_seq_len: optional host-side bound on `seq_lens` (no device sync), which keeps the split-KV
            heuristic from cutting short sequences into empty segments; a wrong value costs speed only.
        workspace: the split-KV scratch; None uses the device's shared one (`split_kv.workspace_for`). On a
            GPU, call once outside CUDA-graph capture so it is sized before a graph captures it.
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
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)):
        raise ValueError(f"max_seq_len must be None or an int (a bound on seq_lens), got {max_seq_len!r}")
    if workspace is not None and workspace.device != device:
        raise ValueError(f"workspace is on {workspace.device}, the tensors on {device}")
    max_query_len = None
    if device.type == "cpu":
        local_lens = dcp_local_seq_lens(seq_lens, dcp_world_size, interleave, dcp_rank)
        max_local_keys = block_table.shape[1] * block_size
        max_query_len = _check_lengths_on_host(query_start_loc, seq_lens, num_tokens, max_local_keys, local_lens)

    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=device)
    if num_tokens == 0 or num_seqs == 0:
        return (out, lse) if return_lse else out

    qpk = num_q_heads // num_kv_heads
    plan = launch_plan(
        q, num_kv_heads, num_seqs, max_query_len, max_seq_len, sliding_window, dcp_world_size, dcp_rank, interleave
    )
    config, num_segments = plan.config, plan.num_segments
    block_q = config.block_m // qpk
    partial_out, partial_lse = out, lse  # placeholders the unsplit kernel never touches
    if num_segments > 1:
        workspace = workspace or workspace_for(device)
        if device.type == "cuda":
            # A split launch never needs more than this (`num_kv_segments`): sized once, outside capture.
            workspace.reserve(TARGET_WAVES * num_sms(device.index) * config.block_m, head_size)
        views = workspace.views(num_tokens, num_q_heads, num_segments, head_size)
        if views is None:
            num_segments = 1
        else:
            partial_out, partial_lse = views

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    paged_attention_kernel[grid](
        q_ptr=q,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        block_table_ptr=block_table,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        out_ptr=out,
        lse_ptr=lse,
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        qk_scale=float(scale) * _LOG2E,
        num_seqs=num_seqs,
        sliding_window=sliding_window or 0,
        dcp_rank=dcp_rank,
        num_segments=num_segments,
        q_stride_t=q.stride(0),
        q_stride_h=q.stride(1),
        out_stride_t=out.stride(0),
        out_stride_h=out.stride(1),
        lse_stride_t=lse.stride(0),
        partial_stride_t=partial_lse.stride(0),
        partial_stride_h=partial_lse.stride(1),
        **cache_strides(key_cache, value_cache),
        block_table_stride=block_table.stride(0),
        NUM_QUERIES_PER_KV=qpk,
        HEAD_SIZE=head_size,
        HEAD_PAD=max(16, next_pow2(head_size)),
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=config.block_n,
        SEQS_PAD=next_pow2(num_seqs + 1),
        USE_WINDOW=sliding_window is not None,
        RETURN_LSE=return_lse,
        DCP_WORLD_SIZE=dcp_world_size,
        INTERLEAVE=interleave,
        DOT_FP32=q.dtype == torch.float32 or interpreting(),
        SPLIT=num_segments > 1,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_segments > 1:
        sms = num_sms(device.index) if device.type == "cuda" else None
        merge_segments(partial_out, partial_lse, out, lse, query_start_loc, return_lse, sms)
    return (out, lse) if return_lse else out
