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
