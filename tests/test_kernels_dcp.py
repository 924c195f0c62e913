"""Decode-context parallelism end to end on the kernels: W ranks each hold a shard of every sequence's KV
(written with compute_slot_mapping + reshape_and_cache), attend over it, and merge_attn_states of the
partial results equals attention over the whole context."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from tests.kernel_helpers import PagedBatch, assert_close, dense_attention, make_batch
from worker.kernels import (
    compute_slot_mapping,
    dcp_local_seq_lens,
    merge_attn_states,
    paged_attention,
    reshape_and_cache,
)
from worker.kernels import reference as ref

paged_attention_module = importlib.import_module("worker.kernels.paged_attention")

DECODE = [(40, 1), (7, 1), (95, 1), (0, 1)]
MIXED = [(0, 21), (33, 9), (66, 1), (12, 1)]


def write_rank_cache(batch: PagedBatch, world: int, rank: int, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's caches after writing every sequence's whole K/V through the slot-mapping kernel."""
    keys, values = torch.cat(batch.keys), torch.cat(batch.values)
    _, num_kv_heads, head_size = keys.shape
    seq_lens = batch.seq_lens.tolist()
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    starts = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32)
    slots = compute_slot_mapping(
        batch.block_table, starts, positions, batch.block_size, dcp_world_size=world, dcp_rank=rank,
        interleave=interleave,
    )
    shape = (batch.num_blocks, batch.block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, float("nan"), dtype=keys.dtype)
    value_cache = torch.full(shape, float("nan"), dtype=keys.dtype)
    reshape_and_cache(keys, values, key_cache, value_cache, slots)
    # Each rank stored exactly its share of every sequence.
    expected = dcp_local_seq_lens(batch.seq_lens, world, interleave, rank).sum().item()
    assert (slots >= 0).sum().item() == expected
    return key_cache, value_cache


def run_dcp_case(
    seqs, world, interleave, dtype=torch.float16, block_size=16, heads=(4, 2), head_size=64, sliding_window=None
):
    num_q_heads, num_kv_heads = heads
    batch = make_batch(seqs, num_q_heads, num_kv_heads, head_size, block_size, dtype, dcp_world_size=world, seed=world)
    outs, lses, twin_outs, twin_lses = [], [], [], []
    for rank in range(world):
        key_cache, value_cache = write_rank_cache(batch, world, rank, interleave)
        args = (batch.q, key_cache, value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, batch.scale)
        kwargs = dict(
            return_lse=True, dcp_world_size=world, dcp_rank=rank, interleave=interleave, sliding_window=sliding_window
        )
        out, lse = paged_attention(*args, **kwargs)
        twin_out, twin_lse = ref.paged_attention(*args, **kwargs)
        assert_close(out, twin_out, dtype, f"rank {rank} vs twin")
        torch.testing.assert_close(lse, twin_lse, atol=1e-3, rtol=1e-4)
        outs.append(out)
        lses.append(lse)
        twin_outs.append(twin_out)
        twin_lses.append(twin_lse)

    merged, merged_lse = merge_attn_states(torch.stack(outs), torch.stack(lses))
    dense_out, dense_lse = dense_attention(batch, sliding_window)
    what = f"W={world} I={interleave} seqs={seqs}"
    assert_close(merged, dense_out, dtype, what)
    torch.testing.assert_close(merged_lse.double(), dense_lse, atol=1e-3, rtol=1e-4)
    twin_merged, _ = ref.merge_attn_states(torch.stack(twin_outs), torch.stack(twin_lses))
    assert_close(twin_merged, dense_out, dtype, f"twins, {what}")


@pytest.mark.parametrize(
    "seqs,world,interleave",
    [
        (DECODE, 1, 1),
        (MIXED, 2, 1),
        (DECODE, 2, 16),
        (MIXED, 4, 2),
        (MIXED, 4, 16),
    ],
    ids=["decode-W1-I1", "mixed-W2-I1", "decode-W2-I16", "mixed-W4-I2", "mixed-W4-I16"],
)
def test_sharded_attention_merges_to_full_attention(seqs, world, interleave):
    run_dcp_case(seqs, world, interleave)


@pytest.mark.parametrize("world,interleave", [(2, 2), (4, 1)])
def test_sharded_attention_with_sliding_window_and_gpu_tiles(monkeypatch, world, interleave):
    # Small key tiles: the window's first visible local key falls inside later tiles on every rank.
    monkeypatch.setattr(paged_attention_module, "TILE_OVERRIDE", (16, 16))
    run_dcp_case([(120, 5), (77, 1), (9, 30)], world, interleave, dtype=torch.float32, sliding_window=29)


@pytest.mark.parametrize("window", [None, 29], ids=["full", "window"])
def test_sharded_attention_split_kv(monkeypatch, window):
    # Every rank splits its keys into 3 segments (16-key tiles): the short sequences leave segments empty,
    # and each rank's partials (merged by LSE inside the kernel call) merge across ranks to full attention.
    monkeypatch.setattr(paged_attention_module, "TILE_OVERRIDE", (16, 16))
    monkeypatch.setattr(paged_attention_module, "NUM_SEGMENTS_OVERRIDE", 3)
    run_dcp_case([(120, 5), (77, 1), (9, 30), (2, 1)], 2, 2, heads=(8, 2), sliding_window=window)


@pytest.mark.slow
@pytest.mark.parametrize("world,interleave", list(itertools.product([1, 2, 4], [1, 2, 16])))
@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_attention_full_sweep(world, interleave, kind, dtype):
    run_dcp_case(DECODE if kind == "decode" else MIXED, world, interleave, dtype=dtype, block_size=32, heads=(8, 2))
