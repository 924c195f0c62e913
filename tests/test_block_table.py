"""BlockTable / MultiGroupBlockTable: exact row contents after each edit, commit, slot mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.block_table import BlockTable, MultiGroupBlockTable, map_to_kernel_blocks


def make_table(**kwargs) -> BlockTable:
    args = dict(block_size=4, max_num_reqs=4, max_num_blocks_per_req=6, max_num_batched_tokens=32)
    args.update(kwargs)
    return BlockTable(**args)


def rows(table: BlockTable) -> list[list[int]]:
    return table.block_table_np.tolist()


def test_append_add_clear_move_swap_exact_contents():
    t = make_table()
    t.add_row([5, 9], 0)
    t.append_row([2], 0)
    t.add_row([7], 2)
    assert rows(t) == [[5, 9, 2, 0, 0, 0], [0] * 6, [7, 0, 0, 0, 0, 0], [0] * 6]
    assert t.num_blocks_per_row.tolist() == [3, 0, 1, 0]

    t.swap_row(0, 2)
    assert rows(t)[:3] == [[7, 0, 0, 0, 0, 0], [0] * 6, [5, 9, 2, 0, 0, 0]]
    assert t.num_blocks_per_row.tolist() == [1, 0, 3, 0]

    t.move_row(2, 1)
    assert rows(t)[:3] == [[7, 0, 0, 0, 0, 0], [5, 9, 2, 0, 0, 0], [0] * 6]
    assert t.num_blocks_per_row.tolist() == [1, 3, 0, 0]

    t.clear_row(1)
    assert rows(t)[1] == [0] * 6 and t.num_blocks_per_row[1] == 0

    # add_row restarts a row: a shorter list leaves no stale tail behind.
    t.add_row([1, 2, 3, 4], 3)
    t.add_row([8], 3)
    assert rows(t)[3] == [8, 0, 0, 0, 0, 0] and t.row(3) == [8]

    # Moving onto a longer row leaves none of the target's old entries.
    t.add_row([1, 2, 3], 2)
    t.move_row(0, 2)
    assert rows(t)[2] == [7, 0, 0, 0, 0, 0] and rows(t)[0] == [0] * 6


def test_append_never_rewrites_earlier_entries():
    t = make_table(max_num_blocks_per_req=40)
    rng = np.random.default_rng(0)
    expected: list[int] = []
    for _ in range(12):
        ids = rng.integers(1, 1000, size=rng.integers(0, 4)).tolist()
        before = t.block_table_np[0, : len(expected)].copy()
        t.append_row(ids, 0)
        assert np.array_equal(t.block_table_np[0, : len(expected)], before)
        expected += ids
        assert t.row(0) == expected


def test_overflow_raises_naming_row_and_sizes_and_changes_nothing():
    t = make_table(max_num_blocks_per_req=3)
    t.add_row([1, 2], 1)
    with pytest.raises(ValueError, match=r"request row 1: appending 2 blocks to its 2 .* row width of 3"):
        t.append_row([3, 4], 1)
    assert t.row(1) == [1, 2]
    with pytest.raises(ValueError, match="row_idx 4"):
        t.append_row([1], 4)
    with pytest.raises(ValueError, match="block ids"):
        t.append_row([-1], 0)


def test_map_to_kernel_blocks():
    assert map_to_kernel_blocks([0, 1, 2], 2).tolist() == [0, 1, 2, 3, 4, 5]
    assert map_to_kernel_blocks([3, 1], 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert map_to_kernel_blocks([3, 1], 1).tolist() == [3, 1]


def test_kernel_block_size_expands_rows_and_slots():
    t = make_table(block_size=32, kernel_block_size=16, max_num_blocks_per_req=2)
    assert t.max_num_blocks_per_req == 4
    t.add_row([3, 1], 0)
    assert t.row(0) == [6, 7, 2, 3]
    t.commit(1)
    slots = t.compute_slot_mapping(1, torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 17, 32, 63]))
    # Position p of allocation block b (32 tokens) = kernel block 2b + p // 16.
    assert slots.tolist() == [3 * 32 + 0, 3 * 32 + 17, 1 * 32 + 0, 1 * 32 + 31]
    with pytest.raises(ValueError, match="kernel_block_size"):
        make_table(block_size=32, kernel_block_size=12)


@pytest.mark.parametrize(
    "interleave,rank,expected",
    [
        (1, 0, [28, -1, 29, -1, 30, -1, 31, -1, 12, -1, 13, -1, 14, -1, 15, -1]),
        (2, 1, [-1, -1, 28, 29, -1, -1, 30, 31, -1, -1, 12, 13, -1, -1, 14, 15]),
    ],
)
def test_slot_mapping_formula_vectors(interleave, rank, expected):
    t = make_table(dcp_world_size=2, dcp_rank=rank, interleave=interleave)
    t.add_row([7, 3], 0)
    t.commit(1)
    slots = t.compute_slot_mapping(1, torch.tensor([0, 16], dtype=torch.int32), torch.arange(16))
    assert slots.tolist() == expected
    assert t.slot_mapping[16:].tolist() == [-1] * 16


def test_commit_mirrors_rows_and_slot_mapping_reads_committed_table():
    t = make_table()
    t.add_row([4], 0)
    t.add_row([9, 2], 1)
    t.commit(2)
    assert t.get_device_tensor(2).tolist() == [[4, 0, 0, 0, 0, 0], [9, 2, 0, 0, 0, 0]]
    t.append_row([6], 0)  # not committed yet: the device still has the old row
    assert t.get_device_tensor()[0, 1] == 0
    t.commit(2)
    assert t.get_device_tensor()[0, 1] == 6
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    slots = t.compute_slot_mapping(2, qsl, torch.tensor([3, 4, 5]))
    assert slots.tolist() == [4 * 4 + 3, 6 * 4 + 0, 2 * 4 + 1]
    # A later, shorter step re-pads the buffer behind it.
    slots = t.compute_slot_mapping(1, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0]))
    assert slots.tolist() == [16]
    assert t.slot_mapping.tolist() == [16] + [-1] * 31


def test_multi_group_table():
    m = MultiGroupBlockTable(
        block_sizes=[16, 32], max_num_reqs=3, max_model_len=1000, max_num_batched_tokens=16,
        kernel_block_sizes=[16, 16],
    )
    assert len(m) == 2
    # cdiv(1000, 16) = 63 rounded up to a multiple of 128 / gcd(128, 16) = 8 -> 64; group 1: 32 -> 32 * 2.
    assert m[0].max_num_blocks_per_req == 64
    assert m[1].max_num_blocks_per_req == 32 * 2
    m.add_row(([1, 2], [5]), 0)
    m.append_row(([3], [6]), 0)
    m.add_row(([7], [8]), 1)
    m.swap_row(0, 1)
    assert m[0].row(1) == [1, 2, 3] and m[1].row(1) == [10, 11, 12, 13]
    m.move_row(1, 2)
    assert m[0].row(1) == [] and m[1].row(2) == [10, 11, 12, 13]
    m.clear_row(0)
    assert m[0].row(0) == [] and m[1].row(0) == []
    m.commit(3)
    slots = m.compute_slot_mapping(3, torch.tensor([0, 0, 0, 2], dtype=torch.int32), torch.tensor([0, 40]))
    assert [s.tolist() for s in slots] == [[16, 3 * 16 + 8], [160, 12 * 16 + 8]]
    with pytest.raises(ValueError, match="groups"):
        m.append_row(([1],), 0)
