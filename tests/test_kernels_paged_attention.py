"""Paged attention (Triton, interpreted on CPU) against the torch twin and dense SDPA on gathered K/V."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from tests.kernel_helpers import assert_close, dense_attention, empty_caches, fill_cache_by_indexing, make_batch
from worker.kernels import paged_attention
from worker.kernels import reference as ref

# The submodule, not the function of the same name that `worker.kernels` exports.
paged_attention_module = importlib.import_module("worker.kernels.paged_attention")

# (context_len, query_len): prefill without context, prefill with context, decodes, a one-token prompt.
MIXED = [(0, 19), (37, 12), (70, 1), (5, 1), (0, 1)]


def run_case(
    seqs, num_q_heads, num_kv_heads, head_size, block_size, dtype, sliding_window=None, seed=0
) -> None:
    batch = make_batch(seqs, num_q_heads, num_kv_heads, head_size, block_size, dtype, seed=seed)
    key_cache, value_cache = empty_caches(batch, num_kv_heads, head_size, dtype)
    fill_cache_by_indexing(batch, key_cache, value_cache)
    args = (batch.q, key_cache, value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, batch.scale)

    out, lse = paged_attention(*args, sliding_window=sliding_window, return_lse=True)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert lse.shape == batch.q.shape[:2] and lse.dtype == torch.float32

    twin_out, twin_lse = ref.paged_attention(*args, sliding_window=sliding_window, return_lse=True)
    dense_out, dense_lse = dense_attention(batch, sliding_window)
    what = f"seqs={seqs} Hq={num_q_heads} Hkv={num_kv_heads} D={head_size} bs={block_size} {dtype} w={sliding_window}"
    assert_close(out, dense_out, dtype, f"vs SDPA, {what}")
    assert_close(out, twin_out, dtype, f"vs twin, {what}")
    torch.testing.assert_close(lse.double(), dense_lse, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(lse, twin_lse, atol=1e-3, rtol=1e-4)
    # The twin is itself checked against SDPA, so the tests of the CPU demo's torch backend mean something.
    assert_close(twin_out, dense_out, dtype, f"twin vs SDPA, {what}")


# A sample of the sweep in which every block size, head size, GQA ratio and dtype appears.
SAMPLED = [
    # block_size, head_size, (Hq, Hkv), dtype, sliding_window
    (16, 64, (4, 4), torch.float32, None),
    (32, 128, (4, 2), torch.float16, None),
    (16, 128, (8, 2), torch.bfloat16, None),
    (32, 64, (8, 1), torch.float16, 24),
    (16, 64, (6, 2), torch.float32, 7),
]


@pytest.mark.parametrize("block_size,head_size,heads,dtype,sliding_window", SAMPLED)
def test_mixed_batch_sampled(block_size, head_size, heads, dtype, sliding_window):
    run_case(MIXED, *heads, head_size, block_size, dtype, sliding_window)


def test_decode_only_batch_long_context():
    # Several key tiles per program; decode rows of different lengths in one launch.
    run_case([(300, 1), (129, 1), (517, 1), (16, 1)], 8, 2, 64, 16, torch.float16, seed=3)


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_gpu_tiles_many_query_blocks_and_key_tiles(monkeypatch, block_n):
    # The GPU's small tiles: several query blocks per prefill, many key tiles per program, so the
    # online-softmax rescaling and tiles that straddle cache blocks are exercised.
    monkeypatch.setattr(paged_attention_module, "TILE_OVERRIDE", (16, block_n))
    run_case([(150, 37), (200, 1), (0, 50)], 8, 2, 64, 16, torch.float32, sliding_window=None, seed=block_n)
    run_case([(90, 20), (61, 1)], 4, 4, 64, 32, torch.bfloat16, sliding_window=45, seed=block_n + 1)


def test_prefill_chunk_spanning_several_query_blocks():
    # More query rows than one program's tile holds, on a context that is not block aligned.
    run_case([(45, 140), (0, 3)], 2, 1, 64, 16, torch.float32, seed=4)


def test_query_rows_past_last_sequence_are_zero():
    batch = make_batch([(3, 2)], 2, 1, 64, 16, torch.float32)
    key_cache, value_cache = empty_caches(batch, 1, 64, torch.float32)
    fill_cache_by_indexing(batch, key_cache, value_cache)
    q = torch.cat([batch.q, torch.randn(3, 2, 64)])  # 3 padding tokens beyond query_start_loc[-1]
    out, lse = paged_attention(
        q, key_cache, value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, 0.1,
        return_lse=True,
    )
    assert torch.equal(out[2:], torch.zeros(3, 2, 64))
    assert torch.isneginf(lse[2:]).all()
    assert torch.isfinite(lse[:2]).all()


def test_rows_that_see_no_key_give_zero_and_neg_inf():
    # DCP rank 1 of 2 with interleave 4 stores positions 4-7, 12-15, ...: a 3-token sequence leaves it
    # nothing, and of a 5-token sequence's queries at positions 2, 3, 4 only the last sees a key (position 4).
    batch = make_batch([(0, 3), (2, 3)], 4, 2, 64, 16, torch.float16, dcp_world_size=2)
    key_cache = torch.zeros(batch.num_blocks, 16, 2, 64, dtype=torch.float16)
    value_cache = torch.ones_like(key_cache)
    out, lse = paged_attention(
        batch.q, key_cache, value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, 0.1,
        return_lse=True, dcp_world_size=2, dcp_rank=1, interleave=4,
    )
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[:5], torch.zeros_like(out[:5]))
    assert torch.isneginf(lse[:5]).all()
    assert torch.isfinite(lse[5]).all()
    torch.testing.assert_close(out[5].float(), torch.ones(4, 64))


@pytest.mark.slow
@pytest.mark.parametrize("tiles", [None, (16, 32)], ids=["device-tiles", "gpu-tiles"])
@pytest.mark.parametrize(
    "block_size,head_size,ratio,dtype,sliding_window",
    list(
        itertools.product(
            [16, 32], [64, 128], [1, 2, 4, 8], [torch.float32, torch.float16, torch.bfloat16], [None, 20]
        )
    ),
)
def test_mixed_batch_full_sweep(monkeypatch, tiles, block_size, head_size, ratio, dtype, sliding_window):
    monkeypatch.setattr(paged_attention_module, "TILE_OVERRIDE", tiles)
    num_kv_heads = 2 if ratio <= 4 else 1
    run_case(MIXED, ratio * num_kv_heads, num_kv_heads, head_size, block_size, dtype, sliding_window, seed=ratio)
