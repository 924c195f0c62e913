"""The descriptor lists of one READ of store pages: which byte ranges of the store's segment land in which rows
of the reader's buffers. Pure arithmetic on addresses, apart from any transport, so it is tested without one."""

from __future__ import annotations

import numpy as np


def page_runs(page_ids: np.ndarray) -> np.ndarray:
    """`[k, 3]` int64 rows (first page id, first row, count): the runs of `page_ids` that go up by one from each
    row to the next, in row order. `[3, 4, 5, 9, 2]` -> `[[3, 0, 3], [9, 3, 1], [2, 4, 1]]`."""
    ids = np.asarray(page_ids, dtype=np.int64)
    if ids.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [ids.size])))
    return np.stack([ids[starts], starts, counts], axis=1)


def row_descs(runs: np.ndarray, remote_base: int, local_base: int, local_row_stride: int, row_bytes: int,
              device_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) `[m, 3]` uint64 descriptor rows (address, bytes, device) copying row `ids[i]` of a remote
    table of `row_bytes`-byte rows to local row `i`. A run becomes one descriptor when the local rows are
    back to back (`local_row_stride == row_bytes`), else one per row. The remote side is host memory (device 0).
    """
    if local_row_stride != row_bytes:  # rows with gaps: split every run into single rows
        ids = np.repeat(runs[:, 0], runs[:, 2]) + _ranks_within(runs[:, 2])
        rows = np.repeat(runs[:, 1], runs[:, 2]) + _ranks_within(runs[:, 2])
        runs = np.stack([ids, rows, np.ones_like(ids)], axis=1)
    m = len(runs)
    remote = np.empty((m, 3), dtype=np.uint64)
    local = np.empty((m, 3), dtype=np.uint64)
    remote[:, 0] = remote_base + runs[:, 0].astype(np.uint64) * np.uint64(row_bytes)
    remote[:, 1] = runs[:, 2].astype(np.uint64) * np.uint64(row_bytes)
    remote[:, 2] = 0
    local[:, 0] = local_base + runs[:, 1].astype(np.uint64) * np.uint64(local_row_stride)
    local[:, 1] = remote[:, 1]
    local[:, 2] = device_id
    return local, remote


def _ranks_within(counts: np.ndarray) -> np.ndarray:
    """0..count-1 for each count, concatenated: `[2, 1, 3]` -> `[0, 1, 0, 0, 1, 2]`."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
