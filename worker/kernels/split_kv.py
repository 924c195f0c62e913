"""Split-KV ("flash-decoding") for paged attention: how many key segments, their scratch, and their merge.

When a launch has too few (query block, KV head) programs to fill the GPU, each program's keys are cut
into segments that run as programs of their own (`paged_attention_kernel` with SPLIT), each writing a
normalised partial output and its log-sum-exp to preallocated fp32 scratch; `merge_segments_kernel` then
combines the segments by LSE exactly as `merge_attn_states` combines DCP ranks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels._common import cdiv, interpreting, next_pow2

# The heuristic's knobs (see `num_kv_segments`).
TARGET_WAVES = 2
MIN_TILES_PER_SEGMENT = 2
MAX_SEGMENTS = 32


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def num_kv_segments(num_programs: int, num_sms: int, max_key_tiles: int | None) -> int:
    """Key segments per (query block, KV head) program, in the spirit of FlashAttention-3's heuristic.

    1. A launch of `num_programs >= num_sms` already covers every SM once: no split (1).
    2. Otherwise aim for TARGET_WAVES (2) programs per SM, so a memory-bound decode has a second program
       in flight to hide load latency: the largest power of two `s` with `num_programs * s <=
       TARGET_WAVES * num_sms`. Powers of two bound the kernel variants a CUDA graph captures.
    3. No segment shorter than MIN_TILES_PER_SEGMENT (2) key tiles when the longest sequence's tile count
       is known (`max_key_tiles`): a segment also pays a query load, a partial write and its merge.
    4. At most MAX_SEGMENTS (32).

    On an H200 (132 SMs) with 8 KV heads and 64-key tiles: batch 1 x 4k -> 32 segments (256 programs),
    1 x 32k -> 32, 4 x 16k -> 8, 8 x 8k -> 4, 16 x 4k -> 2, 32 x 4k and up -> 1; 1 x 512 -> 4 (8 tiles).

    Since `num_programs * s <= TARGET_WAVES * num_sms` and a program covers at most BLOCK_M (token, head)
    rows, a split launch never needs more than `TARGET_WAVES * num_sms * BLOCK_M` scratch rows x segments.
    """
    if num_programs <= 0 or num_programs >= num_sms:
        return 1
    segments = _floor_pow2(TARGET_WAVES * num_sms // num_programs)
    if max_key_tiles is not None:
        segments = min(segments, _floor_pow2(max_key_tiles // MIN_TILES_PER_SEGMENT))
    return max(1, min(segments, MAX_SEGMENTS))


class SplitKVWorkspace:
    """Preallocated fp32 scratch of the split path: partial outputs `[T, H, S, D]` and base-2 LSEs `[T, H, S]`.

    One flat buffer per kind, viewed at the shape of each call, so a call allocates nothing. The buffers
    only grow, and only outside CUDA-graph capture: during capture a call that does not fit gets None and
    runs unsplit. A captured graph keeps the addresses it saw, so a buffer replaced by a larger one on a GPU
    stays alive (`_retired`). Calls sharing a workspace must be ordered (one stream, as a model runner's
    layers are); pass each concurrent stream its own.
    """

    def __init__(self, device: torch.device | str, num_row_segments: int = 0, head_size: int = 0):
        self.device = torch.device(device)
        self._lse = torch.empty(num_row_segments, dtype=torch.float32, device=self.device)
        self._out = torch.empty(num_row_segments * head_size, dtype=torch.float32, device=self.device)
        self._retired: list[torch.Tensor] = []

    def reserve(self, num_row_segments: int, head_size: int) -> bool:
        """Make room for `num_row_segments` (token, head, segment) rows of `head_size`; False if it cannot
        grow now (CUDA-graph capture)."""
        need_lse, need_out = num_row_segments, num_row_segments * head_size
        if self._lse.numel() >= need_lse and self._out.numel() >= need_out:
            return True
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        if self.device.type == "cuda":
            self._retired += [self._lse, self._out]
        self._lse = torch.empty(max(need_lse, self._lse.numel()), dtype=torch.float32, device=self.device)
        self._out = torch.empty(max(need_out, self._out.numel()), dtype=torch.float32, device=self.device)
        return True

    def views(
        self, num_tokens: int, num_heads: int, num_segments: int, head_size: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(partial out `[T, H, S, D]`, partial lse `[T, H, S]`) over the buffers, or None if they cannot fit."""
        rows = num_tokens * num_heads * num_segments
        if not self.reserve(rows, head_size):
            return None
        out = self._out[: rows * head_size].view(num_tokens, num_heads, num_segments, head_size)
        return out, self._lse[:rows].view(num_tokens, num_heads, num_segments)


_WORKSPACES: dict[torch.device, SplitKVWorkspace] = {}


def workspace_for(device: torch.device) -> SplitKVWorkspace:
    """The process-wide workspace of `device`, created empty on first use."""
    if device not in _WORKSPACES:
        _WORKSPACES[device] = SplitKVWorkspace(device)
    return _WORKSPACES[device]


@triton.jit
def merge_segments_kernel(
    partial_out_ptr,  # [num_tokens, num_q_heads, num_segments, head_size] float32
    partial_lse_ptr,  # [num_tokens, num_q_heads, num_segments] float32, base-2 LSE
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    lse_ptr,  # [num_tokens, num_q_heads] float32, natural log; written only when RETURN_LSE
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    num_segments,
    out_stride_t: tl.int64,
    out_stride_h: tl.int64,
    lse_stride_t: tl.int64,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    # Tokens past query_start_loc[-1] belong to no sequence: no program wrote their scratch rows (stale
    # values from an earlier call), so they are skipped here and keep the launcher's 0 / -inf.
    num_rows = tl.load(query_start_loc_ptr + num_seqs).to(tl.int64) * NUM_HEADS
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = row < num_rows
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    seg_row = row * num_segments

    m = tl.full([ROWS], float("-inf"), tl.float32)
    for s in range(0, num_segments):
        m = tl.maximum(m, tl.load(partial_lse_ptr + seg_row + s, mask=row_ok, other=float("-inf")))
    m_shift = tl.where(m == float("-inf"), 0.0, m)

    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    for s in range(0, num_segments):
        weight = tl.math.exp2(tl.load(partial_lse_ptr + seg_row + s, mask=row_ok, other=float("-inf")) - m_shift)
        # An empty segment (lse -inf, weight 0) is never read: its scratch may hold anything.
        used = row_ok & (weight > 0.0)
        part = tl.load(
            partial_out_ptr + (seg_row + s)[:, None] * HEAD_SIZE + dims[None, :],
            mask=used[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc += part * weight[:, None]
        total += weight

    seen = total > 0.0
    merged = acc / tl.where(seen, total, 1.0)[:, None]
    tok = row // NUM_HEADS
    head = row % NUM_HEADS
    dst = (tok * out_stride_t + head * out_stride_h)[:, None] + dims[None, :]
    tl.store(out_ptr + dst, merged.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    if RETURN_LSE:
        lse = tl.where(seen, (m_shift + tl.math.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + tok * lse_stride_t + head, lse, mask=row_ok)


def merge_segments(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    query_start_loc: torch.Tensor,
    return_lse: bool,
    num_sms: int | None,
) -> None:
    """Merge `[T, H, S, D]` partials into `out` `[T, H, D]` and (with `return_lse`) `lse` `[T, H]`, in place.

    Rows of tokens past `query_start_loc[-1]` are left as they are. A GPU gets about one program per SM or
    more (a decode's few rows would otherwise sit in one program); the interpreter gets few large ones.
    """
    num_tokens, num_heads, num_segments, head_size = partial_out.shape
    num_rows = num_tokens * num_heads
    head_pad = next_pow2(head_size)
    if interpreting() or num_sms is None:
        rows = min(max(1, (1 << 15) // head_pad), next_pow2(num_rows))
    else:
        rows = min(16, _floor_pow2(max(1, num_rows // num_sms)))
    merge_segments_kernel[(cdiv(num_rows, rows),)](
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        out_ptr=out,
        lse_ptr=lse,
        query_start_loc_ptr=query_start_loc,
        num_seqs=query_start_loc.shape[0] - 1,
        num_segments=num_segments,
        out_stride_t=out.stride(0),
        out_stride_h=out.stride(1),
        lse_stride_t=lse.stride(0),
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        ROWS=rows,
        RETURN_LSE=return_lse,
    )
