"""Launchers reject bad arguments with a ValueError that names the argument (before any kernel runs)."""

from __future__ import annotations

import re

import pytest
import torch

from worker.kernels import (
    compute_slot_mapping,
    copy_blocks,
    merge_attn_states,
    paged_attention,
    reshape_and_cache,
)

T, HQ, HKV, D, BS, NB = 5, 4, 2, 64, 16, 8


def attention_args(**override):
    args = dict(
        q=torch.randn(T, HQ, D),
        key_cache=torch.randn(NB, BS, HKV, D),
        value_cache=torch.randn(NB, BS, HKV, D),
        block_table=torch.zeros(2, 4, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 5], dtype=torch.int32),
        seq_lens=torch.tensor([9, 4], dtype=torch.int32),
        scale=0.125,
    )
    args.update(override)
    return args


@pytest.mark.parametrize(
    "override,name",
    [
        (dict(q=torch.randn(T, HQ, D, dtype=torch.float64)), "q"),
        (dict(q=torch.randn(T, HQ)), "q"),
        (dict(q=torch.randn(T, HQ, 2 * D)[:, :, ::2]), "q"),  # last dim not contiguous
        (dict(q=torch.randn(T, 3, D)), "Hq % Hkv"),
        (dict(key_cache=torch.randn(NB, BS, HKV, D).half()), "key_cache"),
        (dict(value_cache=torch.randn(NB, BS, HKV + 1, D)), "value_cache"),
        (dict(key_cache=torch.randn(NB, BS, HKV, 32), value_cache=torch.randn(NB, BS, HKV, 32)), "key_cache"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), "block_table"),
        (dict(block_table=torch.zeros(1, 4, dtype=torch.int32)), "block_table"),
        (dict(query_start_loc=torch.tensor([0, 1, 5])), "query_start_loc"),
        (dict(query_start_loc=torch.tensor([0, 3, 2], dtype=torch.int32)), "query_start_loc"),
        (dict(seq_lens=torch.tensor([9], dtype=torch.int32)), "seq_lens"),
        (dict(seq_lens=torch.tensor([9, 3], dtype=torch.int32)), "seq_lens"),  # shorter than its 4 queries
        (dict(seq_lens=torch.tensor([65, 4], dtype=torch.int32)), "block_table row"),  # 4 blocks x 16 < 65
        (dict(sliding_window=0), "sliding_window"),
        (dict(dcp_world_size=2, dcp_rank=2), "dcp_rank"),
        (dict(dcp_world_size=2, interleave=3), "interleave"),
    ],
)
def test_paged_attention_rejects(override, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        paged_attention(**attention_args(**override))


def test_slot_mapping_rejects():
    table = torch.zeros(2, 4, dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="block_table"):
        compute_slot_mapping(table.long(), qsl, pos, 16)
    with pytest.raises(ValueError, match="block_table"):
        compute_slot_mapping(torch.zeros(4, 2, dtype=torch.int32).t(), qsl, pos, 16)
    with pytest.raises(ValueError, match="query_start_loc"):
        compute_slot_mapping(table, qsl.long(), pos, 16)
    with pytest.raises(ValueError, match="positions"):
        compute_slot_mapping(table, qsl, pos.float(), 16)
    with pytest.raises(ValueError, match="positions"):
        compute_slot_mapping(table, qsl, torch.arange(6)[::2], 16)
    with pytest.raises(ValueError, match="out"):
        compute_slot_mapping(table, qsl, pos, 16, out=torch.empty(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="block_size"):
        compute_slot_mapping(table, qsl, pos, 0)
    with pytest.raises(ValueError, match="interleave"):
        compute_slot_mapping(table, qsl, pos, 16, dcp_world_size=2, interleave=5)


def test_reshape_and_cache_rejects():
    key, value = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    kc, vc = torch.zeros(NB, BS, HKV, D), torch.zeros(NB, BS, HKV, D)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="value"):
        reshape_and_cache(key, value.half(), kc, vc, slots)
    with pytest.raises(ValueError, match="key_cache"):
        reshape_and_cache(key, value, torch.zeros(NB, BS, HKV + 1, D), vc, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, value, kc, vc, slots.int())
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, value, kc, vc, torch.arange(4))
    with pytest.raises(ValueError, match="key_cache"):
        reshape_and_cache(key, value, torch.zeros(NB, BS, HKV, 2 * D)[..., ::2], vc, slots)


def test_merge_and_copy_reject():
    with pytest.raises(ValueError, match="lses"):
        merge_attn_states(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4).half())
    with pytest.raises(ValueError, match="lses"):
        merge_attn_states(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5))
    cache = torch.zeros(4, BS, HKV, D)
    with pytest.raises(ValueError, match="pairs"):
        copy_blocks([cache], [cache.clone()], torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="pairs"):
        copy_blocks([cache], [cache.clone()], torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="value_caches"):
        copy_blocks([cache], [], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"value_caches\[0\]"):
        copy_blocks([cache], [torch.zeros(4, BS, HKV, 2 * D)[..., ::2]], torch.tensor([[0, 1]]))
