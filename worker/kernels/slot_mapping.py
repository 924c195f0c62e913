"""Slot mapping: the cache slot each new token's K/V goes to on this DCP rank (−1: another rank's, or padding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels._common import (
    INDEX_DTYPES,
    check_contiguous,
    check_dcp,
    check_kernel_device,
    check_positive,
    check_query_start_loc_on_host,
    check_tensor,
)

PAD_SLOT_ID = -1
_TILE = 1024


@triton.jit
def slot_mapping_kernel(
    block_table_ptr,  # [max_num_reqs, max_num_blocks_per_req] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    positions_ptr,  # [num_tokens] int32 | int64
    slot_mapping_ptr,  # [out_len] int64
    block_table_stride: tl.int64,
    num_reqs,
    max_num_blocks_per_req,
    out_len,
    dcp_rank,
    BLOCK_SIZE: tl.constexpr,
    DCP_WORLD_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    TILE: tl.constexpr,
):
    # int64 indices: slots pass 2**31, and the interpreter checks every int32 add/mul for overflow.
    req = tl.program_id(0)
    offs = tl.arange(0, TILE).to(tl.int64)
    if req == num_reqs:
        # The extra program pads the buffer tail so stale slots from an earlier step are never reused.
        pad_start = tl.load(query_start_loc_ptr + num_reqs).to(tl.int64)
        for i in range(pad_start, out_len, TILE):
            idx = i + offs
            tl.store(slot_mapping_ptr + idx, tl.full([TILE], -1, tl.int64), mask=idx < out_len)
    else:
        start = tl.load(query_start_loc_ptr + req).to(tl.int64)
        end = tl.load(query_start_loc_ptr + req + 1).to(tl.int64)
        row_ptr = block_table_ptr + req.to(tl.int64) * block_table_stride
        for i in range(start, end, TILE):
            idx = i + offs
            in_req = idx < end
            pos = tl.load(positions_ptr + idx, mask=in_req, other=0).to(tl.int64)
            if DCP_WORLD_SIZE == 1:
                vbi = pos // BLOCK_SIZE
                local = pos % BLOCK_SIZE
                mine = in_req
            else:
                vbi = pos // (BLOCK_SIZE * DCP_WORLD_SIZE)
                vbo = pos % (BLOCK_SIZE * DCP_WORLD_SIZE)
                owner = (vbo // INTERLEAVE) % DCP_WORLD_SIZE
                local = (vbo // (DCP_WORLD_SIZE * INTERLEAVE)) * INTERLEAVE + vbo % INTERLEAVE
                mine = in_req & (owner == dcp_rank)
            # Positions past the row width map to -1 rather than reading outside the table.
            mine = mine & (vbi < max_num_blocks_per_req)
            block_id = tl.load(row_ptr + vbi, mask=mine, other=0)
            slot = block_id.to(tl.int64) * BLOCK_SIZE + local
            tl.store(slot_mapping_ptr + idx, tl.where(mine, slot, -1), mask=in_req)


def compute_slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    dcp_world_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cache slot of every scheduled token on this DCP rank.

    Args:
        block_table: int32 `[>= num_reqs, max_num_blocks_per_req]`, row i belonging to request i.
        query_start_loc: int32 `[num_reqs + 1]`, token offsets of each request in `positions`.
        positions: int32/int64 `[T]`, global position of each token in its sequence.
        block_size: per-rank block size (tokens of one sequence a rank stores per block).
        out: optional int64 buffer of length >= T; entries from `query_start_loc[-1]` on are set to -1.
    Returns:
        int64 `[T]` (a view of `out` when given): `block_table[req, p // V] * block_size + local` on the
        owning rank, -1 on the others (V = block_size * dcp_world_size).
    """
    check_positive("block_size", block_size)
    check_dcp(dcp_world_size, dcp_rank, interleave, block_size)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    device = check_kernel_device("block_table", block_table)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous (stride 1), got strides {block_table.stride()}")
    check_contiguous("query_start_loc", query_start_loc)
    check_contiguous("positions", positions)
    num_reqs = query_start_loc.shape[0] - 1
    if num_reqs < 0:
        raise ValueError("query_start_loc must have num_reqs + 1 >= 1 entries, got 0")
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but query_start_loc describes {num_reqs}")
    num_tokens = positions.shape[0]
    if device.type == "cpu":
        check_query_start_loc_on_host(query_start_loc, num_tokens)
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int64, device=device)
    else:
        check_tensor("out", out, ndim=1, dtypes=(torch.int64,), device=device)
        check_contiguous("out", out)
        if out.shape[0] < num_tokens:
            raise ValueError(f"out has {out.shape[0]} entries, fewer than the {num_tokens} positions")
    slot_mapping_kernel[(num_reqs + 1,)](
        block_table_ptr=block_table,
        query_start_loc_ptr=query_start_loc,
        positions_ptr=positions,
        slot_mapping_ptr=out,
        block_table_stride=block_table.stride(0),
        num_reqs=num_reqs,
        max_num_blocks_per_req=block_table.shape[1],
        out_len=out.shape[0],
        dcp_rank=dcp_rank,
        BLOCK_SIZE=block_size,
        DCP_WORLD_SIZE=dcp_world_size,
        INTERLEAVE=interleave,
        TILE=_TILE,
    )
    return out[:num_tokens]
