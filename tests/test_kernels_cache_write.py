"""reshape_and_cache: K/V rows land at their slots in every dtype and layout; slot -1 is skipped."""

from __future__ import annotations

import pytest
import torch

from worker.kernels import paged_attention, reshape_and_cache
from worker.kernels import reference as ref


def random_slots(num_tokens: int, num_slots: int, gen: torch.Generator, skip_every: int = 4) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::skip_every] = -1
    return slots


@pytest.mark.parametrize(
    "dtype,block_size,num_kv_heads,head_size",
    [
        (torch.float32, 16, 2, 64),
        (torch.float16, 32, 4, 128),
        (torch.bfloat16, 16, 1, 80),  # head size that is not a power of two
    ],
)
def test_writes_match_indexing(dtype, block_size, num_kv_heads, head_size):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 12, 70
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    slots = random_slots(num_tokens, num_blocks * block_size, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache, value_cache = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    reshape_and_cache(key, value, key_cache, value_cache, slots)

    keep = slots >= 0
    expected_k, expected_v = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    expected_k.view(-1, num_kv_heads, head_size)[slots[keep]] = key[keep]
    expected_v.view(-1, num_kv_heads, head_size)[slots[keep]] = value[keep]
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)

    twin_k, twin_v = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    ref.reshape_and_cache(key, value, twin_k, twin_v, slots)
    assert torch.equal(twin_k, expected_k) and torch.equal(twin_v, expected_v)


def test_strided_inputs_and_caches():
    # K/V sliced out of a fused QKV projection, caches as views of one [num_blocks, 2, bs, Hkv, D] buffer.
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_kv_heads, head_size, block_size, num_blocks = 20, 2, 64, 16, 4
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_size, generator=gen)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    kv = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_size)
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    slots = random_slots(num_tokens, num_blocks * block_size, gen, skip_every=3)
    reshape_and_cache(key, value, key_cache, value_cache, slots)

    expected = torch.zeros_like(kv)
    ref.reshape_and_cache(key, value, expected[:, 0], expected[:, 1], slots)
    assert torch.equal(kv, expected)
    assert kv.abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_size", [(1, 64), (8, 128), (3, 96)])
def test_writes_full_sweep(dtype, block_size, num_kv_heads, head_size):
    test_writes_match_indexing(dtype, block_size, num_kv_heads, head_size)


def test_cache_offsets_past_int32_then_attention_reads_them():
    # block id * block stride passes 2**31 elements. The caches are 4 GiB each of virtual memory that is
    # never touched except at the few blocks used, so resident memory stays small.
    block_size, num_kv_heads, head_size = 16, 1, 16
    high = 2**23 + 3  # * block stride (256 elements) > 2**31
    shape = (high + 2, block_size, num_kv_heads, head_size)
    try:
        key_cache = torch.empty(shape, dtype=torch.float16)
        value_cache = torch.empty(shape, dtype=torch.float16)
    except RuntimeError as exc:  # no virtual memory for it on this machine
        pytest.skip(f"cannot reserve the large cache: {exc}")
    assert high * key_cache.stride(0) > 2**31
    gen = torch.Generator().manual_seed(3)
    num_tokens = 20
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).half()
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).half()
    # Tokens 0..15 to block `high`, 16..19 to block 5 (a low block must stay correct too).
    slots = torch.cat([high * block_size + torch.arange(16), 5 * block_size + torch.arange(4)])
    key_cache[high].zero_()
    key_cache[5].zero_()
    value_cache[high].zero_()
    value_cache[5].zero_()
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[high].flatten(), key[:16].flatten())
    assert torch.equal(value_cache[5, :4].flatten(), value[16:].flatten())

    # One decode query over the 20 tokens reads them back through the int64 offsets.
    q = torch.randn(1, 2, head_size, generator=gen).half()
    table = torch.tensor([[high, 5]], dtype=torch.int32)
    query_start_loc, seq_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    out = paged_attention(q, key_cache, value_cache, table, query_start_loc, seq_lens, 0.25)
    scores = torch.einsum("hd,khd->hk", q[0].float(), key.float().expand(-1, 2, -1)) * 0.25
    expected = torch.softmax(scores, dim=-1) @ value.float()[:, 0]
    torch.testing.assert_close(out[0].float(), expected, atol=3e-3, rtol=3e-3)
