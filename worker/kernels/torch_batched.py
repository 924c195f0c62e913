"""The `torch` attention backend: the reference twins, with paged attention batched over all sequences.

    backend "torch" -> copy_blocks, reshape_and_cache, slot mapping, merge: `reference` as they are
                    -> paged_attention: the decodes' keys gathered at once, one masked softmax for all of them
The twin in `reference.py` loops over sequences (written to be read, and the kernels' oracle); on CPU that
loop dominated a decode step of 48 sequences. Tests check this one against the twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels import reference
from worker.kernels.dcp import dcp_global_positions, dcp_local_seq_lens
from worker.kernels.reference import compute_slot_mapping, copy_blocks, merge_attn_states, reshape_and_cache

__all__ = ["compute_slot_mapping", "copy_blocks", "merge_attn_states", "paged_attention", "reshape_and_cache"]


@dataclass(slots=True)
class _Plan:
    """What every layer of one step shares: which rows decode, which slots they read and see (the index math
    of a step, done once for all its layers)."""

    prefills: list[tuple]  # fused: (s, e, slots, bias); else (i, s, e, query_start_loc of one)
    rows: torch.Tensor | None = None  # the decodes' tokens
    blocks: torch.Tensor | None = None  # [R * nb]: the blocks each decode reads, whole, row after row
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)  # [R, nb * bs, Hkv, D]
    visible: torch.Tensor | None = None  # [R, L]
    bias: torch.Tensor | None = None  # [R, 1, 1, L]: 0 where visible, -inf elsewhere (SDPA's additive mask)
    hidden: torch.Tensor | None = None  # flat (row, slot) indices of the copies nobody may read


# The last steps' plans as (key, plan), newest first; a key holds copies of the metadata it was made from (compared
# by value: inference tensors keep no version counter). A few of them: a hybrid model's layers alternate groups.
_memo: tuple = ()
_MEMO_SIZE = 4


def _plan(q, key_cache, block_table, query_start_loc, seq_lens, sliding_window, fused, dcp_world_size, dcp_rank,
          interleave) -> _Plan:
    scalars = (tuple(key_cache.shape[1:]), q.shape[1], q.device, sliding_window, fused, dcp_world_size, dcp_rank,
               interleave)
    global _memo
    memo = _memo  # one read: another thread may replace it meanwhile
    for (table, starts, lens, other), plan in memo:
        if other == scalars and _same(table, block_table) and _same(starts, query_start_loc) and _same(lens, seq_lens):
            return plan
    block_size, num_kv_heads, head_size = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    prefills = []
    for i in (q_lens > 1).nonzero().flatten().tolist():
        s, e = int(starts[i]), int(starts[i + 1])
        if fused:
            seq_len = int(seq_lens[i])
            key_pos = torch.arange(seq_len, device=q.device)
            q_pos = key_pos[seq_len - (e - s):]
            visible = key_pos[None, :] <= q_pos[:, None]  # [T, L]
            if sliding_window is not None:
                visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
            slots = block_table[i][key_pos // block_size].long() * block_size + key_pos % block_size
            prefills.append((s, e, slots, _bias(visible)))
        else:
            prefills.append((i, s, e, torch.tensor([0, e - s], dtype=query_start_loc.dtype, device=q.device)))
    plan = _Plan(prefills)
    decodes = (q_lens == 1).nonzero().flatten()
    if decodes.numel():
        plan.rows = starts[decodes]  # each decode's one token
        local_lens = dcp_local_seq_lens(seq_lens[decodes].cpu(), dcp_world_size, interleave, dcp_rank)
        local_lens = local_lens.to(q.device).long()
        # Whole blocks gathered (contiguous copies): local key j sits at block j // bs, offset j % bs.
        num_blocks = -(-max(int(local_lens.max()), 1) // block_size)
        plan.blocks = block_table[decodes, :num_blocks].long().flatten()
        plan.shape = (decodes.numel(), num_blocks * block_size, num_kv_heads, head_size)
        key_idx = torch.arange(plan.shape[1], device=q.device)
        key_pos = dcp_global_positions(key_idx, block_size, dcp_world_size, dcp_rank, interleave)  # [L]
        q_pos = seq_lens[decodes].long() - 1
        visible = (key_idx[None, :] < local_lens[:, None]) & (key_pos[None, :] <= q_pos[:, None])  # [R, L]
        if sliding_window is not None:
            visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
        plan.visible = visible
        plan.bias = _bias(visible)[:, None, None, :]
        plan.hidden = (~visible).flatten().nonzero().flatten()
    key = (block_table.clone(), query_start_loc.clone(), seq_lens.clone(), scalars)
    _memo = ((key, plan),) + memo[:_MEMO_SIZE - 1]
    return plan


def _bias(visible: torch.Tensor) -> torch.Tensor:
    """SDPA's additive mask for a boolean one (faster on CPU than the boolean mask)."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


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
    in one batch, the others (prefill chunks, a few per step) one by one. The index math is the step's
    (`_plan`): the layers of a step pass the same metadata tensors, and it is done for the first of them."""
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    fused = not return_lse and dcp_world_size == 1  # every query sees itself: no empty row, SDPA's own kernel
    lse = None if fused else torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32,
                                        device=q.device)
    plan = _plan(q, key_cache, block_table, query_start_loc, seq_lens, sliding_window, fused, dcp_world_size,
                 dcp_rank, interleave)
    for prefill in plan.prefills:
        if fused:
            s, e, slots, bias = prefill
            out[s:e] = _prefill(q[s:e], key_cache, value_cache, slots, bias, scale)
            continue
        i, s, e, one = prefill
        out[s:e], lse[s:e] = reference.paged_attention(
            q[s:e], key_cache, value_cache, block_table[i:i + 1], one, seq_lens[i:i + 1], scale, sliding_window, True,
            dcp_world_size=dcp_world_size, dcp_rank=dcp_rank, interleave=interleave)
    if plan.rows is not None:
        rows, visible, shape = plan.rows, plan.visible, plan.shape
        # [R, L, Hkv, D]: copies (index_select is several times faster than advanced indexing on CPU).
        keys = key_cache.index_select(0, plan.blocks).reshape(shape).float()
        values = value_cache.index_select(0, plan.blocks).reshape(shape).float()
        # Unread slots may hold anything (NaN in the tests): 0 * NaN (or NaN - inf) would poison the sums.
        # Zeroing the hidden (row, slot) pairs of the copies is ~7x cheaper than a broadcast masked_fill.
        if plan.hidden.numel():
            keys.view(-1, num_kv_heads * head_size).index_fill_(0, plan.hidden, 0.0)
            values.view(-1, num_kv_heads * head_size).index_fill_(0, plan.hidden, 0.0)
        qs = q[rows].float().reshape(-1, num_kv_heads, group, head_size)
        if fused:
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3), attn_mask=plan.bias,
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


def _prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
             bias: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's chunk of T queries (its last T positions) over its keys at `slots` (block * bs + offset;
    all written: no unread slot is gathered), causal and windowed (`bias` [T, L]), through SDPA; DCP 1 only."""
    num_q_heads, num_kv_heads, head_size = q.shape[1], key_cache.shape[2], key_cache.shape[3]
    k = key_cache.reshape(-1, num_kv_heads, head_size).index_select(0, slots).float().permute(1, 0, 2)  # [Hkv, L, D]
    v = value_cache.reshape(-1, num_kv_heads, head_size).index_select(0, slots).float().permute(1, 0, 2)
    qs = q.float().permute(1, 0, 2)  # [Hq, T, D]
    o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=bias, scale=scale,
                                                         enable_gqa=num_q_heads != num_kv_heads)
    return o.permute(1, 0, 2).to(q.dtype)
