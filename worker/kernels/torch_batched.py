"""The `torch` attention backend: the reference twins, with paged attention batched over all sequences.

    backend "torch" -> copy_blocks, reshape_and_cache, slot mapping, merge: `reference` as they are
                    -> paged_attention: the decodes' keys gathered at once, one masked softmax for all of them
The twin in `reference.py` loops over sequences (written to be read, and the kernels' oracle); on CPU that
loop dominated a decode step of 48 sequences. Tests check this one against the twin.
"""

from __future__ import annotations

import torch

from worker.kernels import reference
from worker.kernels.dcp import dcp_global_positions, dcp_local_seq_lens
from worker.kernels.reference import compute_slot_mapping, copy_blocks, merge_attn_states, reshape_and_cache

__all__ = ["compute_slot_mapping", "copy_blocks", "merge_attn_states", "paged_attention", "reshape_and_cache"]

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
    """Same arguments and results as `reference.paged_attention`: sequences computing one token (decodes)
    in one batch, the others (prefill chunks, a few per step) through the twin one by one."""
    num_tokens, num_q_heads, head_size = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    dcp = dict(dcp_world_size=dcp_world_size, dcp_rank=dcp_rank, interleave=interleave)
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    decodes = (q_lens == 1).nonzero().flatten()
    fused = not return_lse and dcp_world_size == 1  # every query sees itself: no empty row, SDPA's own kernel
    for i in (q_lens > 1).nonzero().flatten().tolist():
        s, e = int(starts[i]), int(starts[i + 1])
        if fused:
            out[s:e] = _prefill(q[s:e], key_cache, value_cache, block_table[i], int(seq_lens[i]), scale,
                                sliding_window)
            continue
        one = torch.tensor([0, e - s], dtype=query_start_loc.dtype, device=q.device)
        out[s:e], lse[s:e] = reference.paged_attention(q[s:e], key_cache, value_cache, block_table[i:i + 1], one,
                                                       seq_lens[i:i + 1], scale, sliding_window, True, **dcp)
    if decodes.numel():
        rows = starts[decodes]  # each decode's one token
        local_lens = dcp_local_seq_lens(seq_lens[decodes].cpu(), dcp_world_size, interleave, dcp_rank)
        local_lens = local_lens.to(q.device).long()
        # Whole blocks gathered (contiguous copies): local key j sits at block j // bs, offset j % bs.
        num_blocks = -(-max(int(local_lens.max()), 1) // block_size)
        blocks = block_table[decodes, :num_blocks].long()  # [R, nb]
        shape = (decodes.numel(), num_blocks * block_size, num_kv_heads, head_size)
        keys = key_cache[blocks].reshape(shape).float()  # [R, L, Hkv, D]: copies (advanced indexing)
        values = value_cache[blocks].reshape(shape).float()
        key_idx = torch.arange(shape[1], device=q.device)
        key_pos = dcp_global_positions(key_idx, block_size, dcp_world_size, dcp_rank, interleave)  # [L]
        q_pos = seq_lens[decodes].long() - 1
        visible = (key_idx[None, :] < local_lens[:, None]) & (key_pos[None, :] <= q_pos[:, None])  # [R, L]
        if sliding_window is not None:
            visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
        # Unread slots may hold anything (NaN in the tests): 0 * NaN (or NaN - inf) would poison the sums.
        # Zeroing the hidden (row, slot) pairs of the copies is ~7x cheaper than a broadcast masked_fill.
        hidden = (~visible).flatten().nonzero().flatten()
        if hidden.numel():
            keys.view(-1, num_kv_heads * head_size).index_fill_(0, hidden, 0.0)
            values.view(-1, num_kv_heads * head_size).index_fill_(0, hidden, 0.0)
        qs = q[rows].float().reshape(-1, num_kv_heads, group, head_size)
        if fused:
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3), attn_mask=visible[:, None, None, :],
                scale=scale)  # [R, Hkv, G, D]
            out[rows] = o.reshape(-1, num_q_heads, head_size).to(q.dtype)
            return out
        scores = torch.matmul(qs, keys.permute(0, 2, 3, 1)) * scale  # [R, Hkv, G, L]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [R, Hkv, G]; -inf where nothing is visible
        probs = torch.exp(scores - torch.where(row_lse.isinf(), 0.0, row_lse)[..., None])
        o = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [R, Hkv, G, D]
        out[rows] = o.reshape(-1, num_q_heads, head_size).to(q.dtype)
        lse[rows] = row_lse.reshape(-1, num_q_heads)
    return (out, lse) if return_lse else out


def _prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor, seq_len: int,
             scale: float, sliding_window: int | None) -> torch.Tensor:
    """One sequence's chunk of T queries (its last T positions) over its `seq_len` keys (all written: no
    unread slot is gathered), causal and windowed, through SDPA; DCP 1 only."""
    num_tokens, num_q_heads, head_size = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    key_pos = torch.arange(seq_len, device=q.device)
    blocks = table[key_pos // block_size].long()
    k = key_cache[blocks, key_pos % block_size].float().permute(1, 0, 2)  # [Hkv, L, D]
    v = value_cache[blocks, key_pos % block_size].float().permute(1, 0, 2)
    q_pos = key_pos[seq_len - num_tokens:]
    visible = key_pos[None, :] <= q_pos[:, None]  # [T, L]
    if sliding_window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
    qs = q.float().permute(1, 0, 2)  # [Hq, T, D]
    o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale,
                                                         enable_gqa=num_q_heads != num_kv_heads)
    return o.permute(1, 0, 2).to(q.dtype)
