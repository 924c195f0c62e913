"""Slot mapping kernel: the DCP formula vectors, padding, the torch twin, int64 slots and the per-rank lengths."""

from __future__ import annotations

import itertools

import pytest
import torch

from worker.kernels import PAD_SLOT_ID, compute_slot_mapping, dcp_global_positions, dcp_local_seq_lens
from worker.kernels import reference as ref

ROW = torch.tensor([[7, 3]], dtype=torch.int32)
ONE_REQ = torch.tensor([0, 16], dtype=torch.int32)


@pytest.mark.parametrize(
    "interleave,rank,expected",
    [
        (1, 0, [28, -1, 29, -1, 30, -1, 31, -1, 12, -1, 13, -1, 14, -1, 15, -1]),
        (2, 1, [-1, -1, 28, 29, -1, -1, 30, 31, -1, -1, 12, 13, -1, -1, 14, 15]),
    ],
)
def test_formula_vectors(interleave, rank, expected):
    positions = torch.arange(16)
    for fn in (compute_slot_mapping, ref.compute_slot_mapping):
        slots = fn(ROW, ONE_REQ, positions, 4, dcp_world_size=2, dcp_rank=rank, interleave=interleave)
        assert slots.dtype == torch.int64
        assert slots.tolist() == expected


def test_dcp_local_seq_lens_vector():
    assert dcp_local_seq_lens(13, 2, 1).tolist() == [7, 6]
    assert dcp_local_seq_lens(torch.tensor([13]), 2, 1, dcp_rank=1).tolist() == [6]


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (2, 4), (4, 2), (4, 16)])
def test_local_lengths_and_positions_agree_with_slot_mapping(world, interleave):
    # Independent check of the helpers: count and locate each rank's tokens by brute force.
    block_size, seq_len = 16, 150
    table = torch.arange(20, dtype=torch.int32)[None]
    owners_seen = torch.zeros(seq_len, dtype=torch.int64)
    for rank in range(world):
        slots = ref.compute_slot_mapping(
            table, torch.tensor([0, seq_len], dtype=torch.int32), torch.arange(seq_len), block_size,
            dcp_world_size=world, dcp_rank=rank, interleave=interleave,
        )
        mine = torch.nonzero(slots >= 0).flatten()
        owners_seen[mine] += 1
        for n in range(seq_len + 1):
            assert dcp_local_seq_lens(n, world, interleave, rank).item() == int((mine < n).sum())
        # Local key j of this rank (slot j, since the table is the identity) sits at global position mine[j].
        local = slots[mine]
        assert torch.equal(local, torch.arange(mine.numel()))
        assert torch.equal(dcp_global_positions(local, block_size, world, rank, interleave), mine)
    assert torch.equal(owners_seen, torch.ones(seq_len, dtype=torch.int64))


def test_padding_and_out_buffer():
    positions = torch.tensor([0, 1, 2, 5, 6], dtype=torch.int64)
    query_start_loc = torch.tensor([0, 3, 5], dtype=torch.int32)
    table = torch.tensor([[4, 9], [2, 8]], dtype=torch.int32)
    out = torch.full((12,), 777, dtype=torch.int64)
    slots = compute_slot_mapping(table, query_start_loc, positions, 4, out=out)
    assert slots.data_ptr() == out.data_ptr() and slots.shape == (5,)
    assert out.tolist() == [16, 17, 18, 33, 34] + [PAD_SLOT_ID] * 7


@pytest.mark.parametrize("world,interleave,rank", [(1, 1, 0), (2, 1, 1), (4, 2, 3), (2, 16, 0)])
def test_random_batches_match_twin(world, interleave, rank):
    gen = torch.Generator().manual_seed(world * 10 + rank)
    block_size = 32
    lens = [1, 70, 5, 200, 33]
    starts = [0, 3, 64, 10, 1]  # first scheduled position of each request (context before it)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
    query_start_loc = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    table = torch.randint(0, 5000, (6, 8), generator=gen, dtype=torch.int32)
    kwargs = dict(dcp_world_size=world, dcp_rank=rank, interleave=interleave)
    got = compute_slot_mapping(table, query_start_loc, positions, block_size, **kwargs)
    want = ref.compute_slot_mapping(table, query_start_loc, positions, block_size, **kwargs)
    assert torch.equal(got, want)
    assert (got >= 0).sum() > 0


def test_slots_past_int32():
    # Block ids near 2**27 with block size 32 give slots past 2**32: int32 math would wrap.
    block_size = 32
    table = torch.tensor([[2**27 - 1, 2**27 + 5, 2**28 + 3], [2**26, 1, 2**27]], dtype=torch.int32)
    positions = torch.tensor([0, 31, 32, 70, 95, 40], dtype=torch.int64)
    query_start_loc = torch.tensor([0, 5, 6], dtype=torch.int32)
    got = compute_slot_mapping(table, query_start_loc, positions, block_size)
    expected = [
        (2**27 - 1) * 32,
        (2**27 - 1) * 32 + 31,
        (2**27 + 5) * 32,
        (2**28 + 3) * 32 + 6,
        (2**28 + 3) * 32 + 31,
        1 * 32 + 8,
    ]
    assert got.tolist() == expected
    assert max(expected) > 2**32
    assert torch.equal(got, ref.compute_slot_mapping(table, query_start_loc, positions, block_size))


def test_positions_past_row_width_map_to_pad():
    table = torch.tensor([[3, 4]], dtype=torch.int32)
    got = compute_slot_mapping(table, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([7, 8, 9]), 4)
    assert got.tolist() == [19, -1, -1]
