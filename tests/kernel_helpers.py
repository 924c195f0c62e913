"""Shared builders and independent references for the kernel tests.

References here never call `worker.kernels` or its torch twins: dense attention goes through
`torch.nn.functional.scaled_dot_product_attention` (LSE through an explicit float64 logsumexp), and caches
for W = 1 are filled by plain indexing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TOLERANCES = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype], msg=lambda m: f"{what}: {m}")


@dataclass(slots=True)
class PagedBatch:
    """A varlen batch: per-sequence full K/V in global order, queries, and a shuffled block table."""

    q: torch.Tensor  # [T, Hq, D]
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    values: list[torch.Tensor]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, max_blocks]; ids of allocation blocks (bs * W tokens each)
    block_size: int  # per-rank block size
    num_blocks: int
    scale: float


def make_batch(
    seqs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    dcp_world_size: int = 1,
    seed: int = 0,
    spare_blocks: int = 5,
) -> PagedBatch:
    """`seqs` lists (context_len, query_len) per sequence; blocks are drawn from a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    virtual = block_size * dcp_world_size
    blocks_per_seq = [max(1, math.ceil((c + n) / virtual)) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seqs), max(blocks_per_seq) + 2, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = pool[used : used + n]
        used += n

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    keys = [randn(c + n, num_kv_heads, head_size) for c, n in seqs]
    values = [randn(c + n, num_kv_heads, head_size) for c, n in seqs]
    q = randn(sum(n for _, n in seqs), num_q_heads, head_size)
    q_lens = torch.tensor([0] + [n for _, n in seqs])
    return PagedBatch(
        q=q,
        keys=keys,
        values=values,
        query_start_loc=torch.cumsum(q_lens, 0).to(torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_table=table,
        block_size=block_size,
        num_blocks=num_blocks,
        scale=1.0 / math.sqrt(head_size),
    )


def fill_cache_by_indexing(batch: PagedBatch, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Write every sequence's K/V into W = 1 caches by plain indexing (independent of the kernels)."""
    bs = batch.block_size
    for i, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        pos = torch.arange(k.shape[0])
        blocks = batch.block_table[i, pos // bs].long()
        key_cache[blocks, pos % bs] = k
        value_cache[blocks, pos % bs] = v


def empty_caches(batch: PagedBatch, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> tuple:
    """Caches pre-filled with NaN, so a kernel that reads an unwritten slot cannot pass."""
    shape = (batch.num_blocks, batch.block_size, num_kv_heads, head_size)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


def dense_attention(
    batch: PagedBatch, sliding_window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over each sequence's whole K/V with SDPA; LSE from a float64 logsumexp.

    Returns out `[T, Hq, D]` float32 and lse `[T, Hq]` float64 (-inf where a row sees no key).
    """
    outs, lses = [], []
    qsl = batch.query_start_loc.tolist()
    num_q_heads = batch.q.shape[1]
    for i, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.q[qsl[i] : qsl[i + 1]].double()
        seq_len, num_kv_heads = k.shape[0], k.shape[1]
        group = num_q_heads // num_kv_heads
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)
        k_pos = torch.arange(seq_len)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=batch.scale
        ).transpose(0, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1).transpose(0, 1)
        outs.append(out.float())
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
