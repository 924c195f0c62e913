"""merge_attn_states (log-sum-exp combine, never NaN) and copy_blocks (copy-on-write / transfers)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import assert_close
from worker.kernels import copy_blocks, merge_attn_states
from worker.kernels import reference as ref


def split_attention(num_parts: int, num_tokens: int, num_heads: int, head_size: int, gen: torch.Generator):
    """Attention of random queries over random keys dealt to `num_parts` disjoint shards (some empty)."""
    num_keys = 23
    q = torch.randn(num_tokens, num_heads, head_size, generator=gen, dtype=torch.float64)
    k = torch.randn(num_keys, num_heads, head_size, generator=gen, dtype=torch.float64)
    v = torch.randn(num_keys, num_heads, head_size, generator=gen, dtype=torch.float64)
    owner = torch.randint(0, num_parts, (num_keys,), generator=gen)
    owner[owner == num_parts - 1] = 0  # the last part owns nothing: lse -inf everywhere
    scores = torch.einsum("thd,khd->thk", q, k)
    outs, lses = [], []
    for part in range(num_parts):
        masked = scores.masked_fill((owner != part)[None, None, :], float("-inf"))
        lse = torch.logsumexp(masked, dim=-1)
        probs = torch.exp(masked - torch.where(lse.isinf(), 0.0, lse)[..., None])
        outs.append(torch.einsum("thk,khd->thd", probs, v))
        lses.append(lse)
    full_lse = torch.logsumexp(scores, dim=-1)
    full_out = torch.einsum("thk,khd->thd", torch.softmax(scores, dim=-1), v)
    return torch.stack(outs), torch.stack(lses), full_out, full_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_parts,head_size", [(2, 64), (4, 128), (3, 80)])
def test_merge_equals_attention_over_union(dtype, num_parts, head_size):
    gen = torch.Generator().manual_seed(num_parts)
    outs, lses, full_out, full_lse = split_attention(num_parts, 9, 3, head_size, gen)
    out, lse = merge_attn_states(outs.to(dtype), lses.float())
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, full_out, dtype, "merged out")
    torch.testing.assert_close(lse.double(), full_lse, atol=1e-5, rtol=1e-5)
    twin_out, twin_lse = ref.merge_attn_states(outs.to(dtype), lses.float())
    assert_close(twin_out, full_out, dtype, "twin merged out")
    torch.testing.assert_close(twin_lse, lse, atol=1e-5, rtol=1e-5)


def test_merge_never_nan():
    num_parts, num_tokens, num_heads, head_size = 3, 4, 2, 16
    outs = torch.randn(num_parts, num_tokens, num_heads, head_size)
    lses = torch.randn(num_parts, num_tokens, num_heads)
    lses[:, 0] = float("-inf")  # token 0: every part empty
    outs[:, 0] = float("nan")  # whatever an empty part left behind must not leak
    lses[1, 1] = float("-inf")
    outs[1, 1] = float("nan")
    lses[2, 2] = float("inf")  # +inf and NaN are treated as empty parts, as in vLLM
    lses[0, 3] = float("nan")
    for fn in (merge_attn_states, ref.merge_attn_states):
        out, lse = fn(outs, lses)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert torch.equal(out[0], torch.zeros(num_heads, head_size))
        assert torch.isneginf(lse[0]).all()
        # Token 1: parts 0 and 2 only.
        w = torch.softmax(lses[[0, 2], 1], dim=0)
        torch.testing.assert_close(out[1], w[0, :, None] * outs[0, 1] + w[1, :, None] * outs[2, 1])
        # A single live part passes through unchanged; a NaN LSE makes it empty.
        single, single_lse = fn(outs[:1, 2:], lses[:1, 2:])
        torch.testing.assert_close(single[0], outs[0, 2])
        torch.testing.assert_close(single_lse[0], lses[0, 2])
        assert torch.equal(single[1], torch.zeros(num_heads, head_size)) and torch.isneginf(single_lse[1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_every_layer(dtype):
    gen = torch.Generator().manual_seed(5)
    num_layers, shape = 3, (10, 16, 2, 32)
    key_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
    value_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
    pairs = torch.tensor([[1, 7], [4, 2], [9, 0]], dtype=torch.int64)
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]
    for cache in expected_k + expected_v:
        for src, dst in pairs.tolist():
            cache[dst] = cache[src]
    before = [c.clone() for c in key_caches + value_caches]
    copy_blocks(key_caches, value_caches, pairs)
    for got, want, old in zip(key_caches + value_caches, expected_k + expected_v, before, strict=True):
        assert torch.equal(got, want)
        assert not torch.equal(got, old)

    twin_k = [c.clone() for c in before[:num_layers]]
    twin_v = [c.clone() for c in before[num_layers:]]
    ref.copy_blocks(twin_k, twin_v, pairs)
    for got, want in zip(twin_k + twin_v, expected_k + expected_v, strict=True):
        assert torch.equal(got, want)


def test_copy_blocks_strided_block_layout_and_empty_pairs():
    # K and V as views of a [num_blocks, 2, bs, Hkv, D] buffer: blocks are contiguous, the block stride is not.
    kv = torch.randn(6, 2, 4, 2, 8)
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    expected = kv.clone()
    expected[3] = expected[0]
    copy_blocks([key_cache], [value_cache], torch.tensor([[0, 3]]))
    assert torch.equal(kv, expected)
    copy_blocks([key_cache], [value_cache], torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(kv, expected)
