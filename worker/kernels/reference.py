"""Pure-torch twins of every kernel: same signatures and results, written to be read.

Tests compare the Triton kernels against these; the CPU demo uses `paged_attention` here as its `torch`
attention backend, so it is vectorised per sequence rather than per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.kernels.dcp import dcp_global_positions, dcp_local_seq_lens


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
    """Twin of `worker.kernels.compute_slot_mapping`."""
    num_tokens = positions.shape[0]
    qsl = query_start_loc.long()
    num_reqs = qsl.shape[0] - 1
    req = torch.repeat_interleave(torch.arange(num_reqs, device=qsl.device), qsl[1:] - qsl[:-1])
    pos = positions[: req.shape[0]].long()
    w, i = dcp_world_size, interleave
    vbi, vbo = pos // (block_size * w), pos % (block_size * w)
    owner = (vbo // i) % w
    local = (vbo // (w * i)) * i + vbo % i
    mine = (owner == dcp_rank) & (vbi < block_table.shape[1])
    block = block_table[req, vbi.clamp(max=block_table.shape[1] - 1)].long()
    slots = torch.where(mine, block * block_size + local, -1)
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int64, device=positions.device)
    out.fill_(-1)
    out[: slots.shape[0]] = slots
    return out[:num_tokens]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Twin of `worker.kernels.reshape_and_cache`."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache[slots // block_size, slots % block_size] = key[keep]
    value_cache[slots // block_size, slots % block_size] = value[keep]


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
    """Twin of `worker.kernels.paged_attention`: gathers each sequence's K/V and attends in fp32."""
    num_tokens, num_q_heads, head_size = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    local_lens = dcp_local_seq_lens(seq_lens.cpu(), dcp_world_size, interleave, dcp_rank).tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        key_idx = torch.arange(local_lens[i], device=q.device)
        blocks = block_table[i, key_idx // block_size].long()
        k = key_cache[blocks, key_idx % block_size].float()  # [L, Hkv, D]
        v = value_cache[blocks, key_idx % block_size].float()
        key_pos = dcp_global_positions(key_idx, block_size, dcp_world_size, dcp_rank, interleave)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)

        visible = key_pos[None, :] <= q_pos[:, None]  # [q_len, L]
        if sliding_window is not None:
            visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
        # [Hkv, group * q_len, D]: query heads of one KV head share its keys.
        qs = q[start:end].float().reshape(-1, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        scores = torch.matmul(qs, k.permute(1, 2, 0)[:, None]) * scale  # [Hkv, group, q_len, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is visible
        probs = torch.exp(scores - torch.where(row_lse.isinf(), 0.0, row_lse)[..., None])
        o = torch.matmul(probs, v.permute(1, 0, 2)[:, None])  # [Hkv, group, q_len, D]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(end - start, num_q_heads, head_size).to(q.dtype)
        lse[start:end] = row_lse.permute(2, 0, 1).reshape(end - start, num_q_heads)
    return (out, lse) if return_lse else out


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `worker.kernels.merge_attn_states`."""
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), float("-inf"), lses.float())
    lse = torch.logsumexp(lses, dim=0)  # [T, H]; -inf when every part is empty
    weights = torch.exp(lses - torch.where(lse.isinf(), 0.0, lse)[None])  # [W, T, H]
    parts = torch.where(weights[..., None] > 0, outs.float() * weights[..., None], 0.0)
    return parts.sum(dim=0).to(outs.dtype), lse


def copy_blocks(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], pairs: torch.Tensor
) -> None:
    """Twin of `worker.kernels.copy_blocks`."""
    src, dst = pairs[:, 0], pairs[:, 1]
    for cache in [*key_caches, *value_caches]:
        cache[dst] = cache[src]
