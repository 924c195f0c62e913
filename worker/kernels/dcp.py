"""Decode-context parallelism (DCP) index math, shared by the kernels, their twins and the block table.

W ranks shard every sequence's KV: a virtual block of `block_size * W` tokens is split into runs of
`interleave` tokens dealt round-robin to the ranks, so each rank stores `block_size` tokens per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dcp_local_seq_lens(
    seq_lens: torch.Tensor | int, dcp_world_size: int, interleave: int = 1, dcp_rank: int | None = None
) -> torch.Tensor:
    """Number of a sequence's tokens each DCP rank stores.

    Args:
        seq_lens: global sequence lengths (any shape) or a single int.
        dcp_rank: one rank, or None for all ranks.
    Returns:
        int tensor of shape `seq_lens.shape + (W,)`, or `seq_lens.shape` when `dcp_rank` is given.
        Example: seq 13, W 2, interleave 1 -> [7, 6].
    """
    seq = torch.as_tensor(seq_lens, dtype=torch.int64)
    w, i = dcp_world_size, interleave
    base = seq // i // w * i
    ranks = torch.arange(w, device=seq.device) if dcp_rank is None else torch.tensor(dcp_rank)
    if dcp_rank is None:
        base, seq = base.unsqueeze(-1), seq.unsqueeze(-1)
    return base + torch.clamp(seq - base * w - ranks * i, 0, i)


def dcp_global_positions(
    local_idx: torch.Tensor, block_size: int, dcp_world_size: int, dcp_rank: int, interleave: int = 1
) -> torch.Tensor:
    """Global token position of each local key index `j` stored on `dcp_rank` (inverse of slot mapping)."""
    w, i = dcp_world_size, interleave
    off = local_idx % block_size
    return (local_idx // block_size) * (block_size * w) + (off // i) * (w * i) + dcp_rank * i + off % i


@triton.jit
def dcp_local_len(seq, DCP_WORLD_SIZE: tl.constexpr, dcp_rank, INTERLEAVE: tl.constexpr):
    """Triton twin of `dcp_local_seq_lens` for one rank; `seq` must be >= 0."""
    if DCP_WORLD_SIZE == 1:
        local = seq
    else:
        base = seq // INTERLEAVE // DCP_WORLD_SIZE * INTERLEAVE
        extra = seq - base * DCP_WORLD_SIZE - dcp_rank * INTERLEAVE
        local = base + tl.minimum(tl.maximum(extra, 0), INTERLEAVE)
    return local


@triton.jit
def dcp_global_pos(
    local_idx, BLOCK_SIZE: tl.constexpr, DCP_WORLD_SIZE: tl.constexpr, dcp_rank, INTERLEAVE: tl.constexpr
):
    """Triton twin of `dcp_global_positions`."""
    if DCP_WORLD_SIZE == 1:
        pos = local_idx
    else:
        off = local_idx % BLOCK_SIZE
        pos = (
            (local_idx // BLOCK_SIZE) * (BLOCK_SIZE * DCP_WORLD_SIZE)
            + (off // INTERLEAVE) * (DCP_WORLD_SIZE * INTERLEAVE)
            + dcp_rank * INTERLEAVE
            + off % INTERLEAVE
        )
    return pos
