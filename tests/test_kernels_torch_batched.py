"""The torch backend's batched paged attention against the per-sequence twin (the kernels' oracle):
mixed prefill/decode batches, GQA, sliding windows, DCP shards, dtypes."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import assert_close, empty_caches, fill_cache_by_indexing, make_batch
from tests.test_kernels_dcp import write_rank_cache
from worker.kernels import reference as ref
from worker.kernels import torch_batched

MIXED = [(0, 19), (37, 12), (70, 1), (5, 1), (0, 1)]


def compare(batch, key_cache, value_cache, dtype, **kwargs) -> None:
    args = (batch.q, key_cache, value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, batch.scale)
    out, lse = torch_batched.paged_attention(*args, return_lse=True, **kwargs)
    twin_out, twin_lse = ref.paged_attention(*args, return_lse=True, **kwargs)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, twin_out, dtype, f"{kwargs}")
    torch.testing.assert_close(lse, twin_lse, atol=1e-4, rtol=1e-4)
    assert not torch.isnan(out).any()
    if kwargs.get("dcp_world_size", 1) == 1:  # without the LSE the decodes take the fused SDPA path
        plain = torch_batched.paged_attention(*args, **kwargs)
        assert_close(plain, twin_out, dtype, f"{kwargs}, no lse")
        assert not torch.isnan(plain).any()


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("sliding_window", [None, 1, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_equals_the_twin(heads, sliding_window, dtype):
    batch = make_batch(MIXED, heads[0], heads[1], 32, 16, dtype, seed=1)
    key_cache, value_cache = empty_caches(batch, heads[1], 32, dtype)  # NaN where nothing was written
    fill_cache_by_indexing(batch, key_cache, value_cache)
    compare(batch, key_cache, value_cache, dtype, sliding_window=sliding_window)


@pytest.mark.parametrize("world, interleave", [(2, 1), (2, 4), (4, 2)])
def test_batched_equals_the_twin_on_every_dcp_rank(world, interleave):
    batch = make_batch(MIXED, 4, 2, 64, 16, torch.float16, dcp_world_size=world, seed=world)
    for rank in range(world):
        key_cache, value_cache = write_rank_cache(batch, world, rank, interleave)
        compare(batch, key_cache, value_cache, torch.float16, dcp_world_size=world, dcp_rank=rank,
                interleave=interleave)


def test_long_prefill_beside_decodes():
    batch = make_batch([(10, 300), (40, 1), (0, 5), (3, 1)], 4, 2, 16, 16, torch.float32, seed=3)
    key_cache, value_cache = empty_caches(batch, 2, 16, torch.float32)
    fill_cache_by_indexing(batch, key_cache, value_cache)
    compare(batch, key_cache, value_cache, torch.float32)


def test_a_steps_plan_is_reused_only_for_the_same_unchanged_metadata():
    """The layers of a step share its index math (the same metadata tensors); changed in place, or new
    tensors with the same values, the plan is made again: each call equals the twin."""
    batch = make_batch(MIXED, 4, 2, 32, 16, torch.float32, seed=4)
    key_cache, value_cache = empty_caches(batch, 2, 32, torch.float32)
    fill_cache_by_indexing(batch, key_cache, value_cache)
    args = lambda: (batch.q, key_cache, value_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,  # noqa: E731
                    batch.scale)
    first = torch_batched.paged_attention(*args())
    assert torch_batched.paged_attention(*args()) is not first  # a fresh output, from the same plan
    assert torch.equal(torch_batched._memo[0][0][0], batch.block_table)
    batch.seq_lens[2] -= 1  # a decode now reads one key fewer: the version changed
    assert_close(torch_batched.paged_attention(*args()), ref.paged_attention(*args()), torch.float32, "seq_lens")
    moved = int(batch.block_table[0, 1])
    spare = max(set(range(key_cache.shape[0])) - set(batch.block_table.flatten().tolist()))
    for cache in (key_cache, value_cache):  # row 0's second block moves: the old one holds NaN now
        cache[spare] = cache[moved]
        cache[moved] = float("nan")
    before = ref.paged_attention(*args())  # NaN: the twin reads the old block too
    batch.block_table[0, 1] = spare
    out = torch_batched.paged_attention(*args())
    assert not torch.isnan(out).any() and torch.isnan(before).any()
    assert_close(out, ref.paged_attention(*args()), torch.float32, "table")
    batch.block_table = batch.block_table.clone()
    assert_close(torch_batched.paged_attention(*args()), ref.paged_attention(*args()), torch.float32, "new table")
