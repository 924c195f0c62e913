"""Per-request block tables of a worker: which cache blocks hold each running request's KV.

Rows live in (pinned) CPU memory where the engine edits them cheaply; `commit` mirrors them on the device
and `compute_slot_mapping` turns a step's token positions into this DCP rank's cache slots with a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from worker.kernels import compute_slot_mapping
from worker.kernels._common import check_dcp, check_positive

_INT32_MAX = 2**31 - 1


def map_to_kernel_blocks(block_ids: Sequence[int] | np.ndarray, blocks_per_kv_block: int) -> np.ndarray:
    """Expand allocation block ids into the kernel blocks they consist of.

    An allocation block of `k * kernel_block_size` tokens is kernel blocks `id * k + [0, k)`:
    `map_to_kernel_blocks([0, 1, 2], 2) == [0, 1, 2, 3, 4, 5]`.
    """
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1)
    if blocks_per_kv_block == 1:
        return ids.reshape(-1)
    return (ids * blocks_per_kv_block + np.arange(blocks_per_kv_block)).reshape(-1)


class BlockTable:
    """int32 table `[max_num_reqs, max_num_blocks_per_req]` of one KV-cache group, plus its slot mapping.

    Row i holds the block ids of the request in batch slot i; `num_blocks_per_row[i]` of them are valid and
    every entry past that is 0. Appending never rewrites earlier entries.

    Args:
        block_size: per-rank block size of the allocator's blocks (a block spans
            `block_size * dcp_world_size` tokens of a sequence).
        max_num_blocks_per_req: row width in allocation blocks.
        max_num_batched_tokens: length of the slot-mapping buffer (its tail is padded with -1).
        kernel_block_size: block size the kernels see; must divide `block_size`. Each allocation block
            is stored as `block_size // kernel_block_size` kernel blocks (see `map_to_kernel_blocks`).
        pin_memory: pin the CPU rows (default: when the device is a CUDA device).
    """

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        device: torch.device | str = "cpu",
        pin_memory: bool | None = None,
        kernel_block_size: int | None = None,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        interleave: int = 1,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_num_reqs", max_num_reqs),
            ("max_num_blocks_per_req", max_num_blocks_per_req),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            check_positive(name, value)
        kernel_block_size = block_size if kernel_block_size is None else kernel_block_size
        check_positive("kernel_block_size", kernel_block_size)
        if block_size % kernel_block_size != 0:
            raise ValueError(
                f"kernel_block_size {kernel_block_size} must divide the allocation block_size {block_size}"
            )
        check_dcp(dcp_world_size, dcp_rank, interleave, kernel_block_size)
        self.device = torch.device(device)
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        pin_memory = pin_memory and torch.cuda.is_available()
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.blocks_per_kv_block = block_size // kernel_block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req * self.blocks_per_kv_block
        self.max_num_batched_tokens = max_num_batched_tokens
        self.dcp_world_size = dcp_world_size
        self.dcp_rank = dcp_rank
        self.interleave = interleave

        shape = (max_num_reqs, self.max_num_blocks_per_req)
        self.block_table_cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=pin_memory)
        self.block_table_np = self.block_table_cpu.numpy()
        self.block_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping = torch.full(
            (max_num_batched_tokens,), -1, dtype=torch.int64, device=self.device
        )

    # Row edits (CPU only; call `commit` before the kernels read the rows).

    def append_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Append allocation block ids to row `row_idx`; earlier entries are never rewritten."""
        self._check_row("row_idx", row_idx)
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return
        if ids.min() < 0 or ids.max() * self.blocks_per_kv_block + self.blocks_per_kv_block - 1 > _INT32_MAX:
            raise ValueError(
                f"request row {row_idx}: block ids must be in [0, 2**31) after expansion to kernel blocks, "
                f"got min {ids.min()} max {ids.max()}"
            )
        ids = map_to_kernel_blocks(ids, self.blocks_per_kv_block)
        start = int(self.num_blocks_per_row[row_idx])
        end = start + ids.size
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"request row {row_idx}: appending {ids.size} blocks to its {start} would exceed the row width "
                f"of {self.max_num_blocks_per_req} blocks (block_size {self.kernel_block_size}); raise "
                "max_num_blocks_per_req (max_model_len) or stop the request earlier"
            )
        self.block_table_np[row_idx, start:end] = ids
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Start row `row_idx` afresh with `block_ids` (a new or resumed request in that batch slot)."""
        self.clear_row(row_idx)
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        """Empty row `row_idx`, zeroing its used prefix."""
        self._check_row("row_idx", row_idx)
        self.block_table_np[row_idx, : self.num_blocks_per_row[row_idx]] = 0
        self.num_blocks_per_row[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Move row `src` to `tgt` (batch condensing); `src` is left empty and zeroed."""
        self._check_row("src", src)
        self._check_row("tgt", tgt)
        if src == tgt:
            return
        num = int(self.num_blocks_per_row[src])
        self.clear_row(tgt)
        self.block_table_np[tgt, :num] = self.block_table_np[src, :num]
        self.num_blocks_per_row[tgt] = num
        self.clear_row(src)

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange rows `src` and `tgt` (batch reordering)."""
        self._check_row("src", src)
        self._check_row("tgt", tgt)
        self.block_table_np[[src, tgt]] = self.block_table_np[[tgt, src]]
        self.num_blocks_per_row[[src, tgt]] = self.num_blocks_per_row[[tgt, src]]

    # Device side.

    def commit(self, num_reqs: int) -> None:
        """Copy the first `num_reqs` rows to the device table."""
        self._check_num_reqs(num_reqs)
        # Asynchronous from pinned memory: rows must not be edited again before the step's kernels ran.
        self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs], non_blocking=True)

    def compute_slot_mapping(
        self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Slots of this step's tokens on this DCP rank, from the committed device table.

        Args:
            query_start_loc: int32 `[>= num_reqs + 1]` token offsets of rows 0..num_reqs-1.
            positions: int64 `[T]` global positions of the step's tokens.
        Returns:
            int64 `[T]`, a view of `self.slot_mapping` whose tail past T holds -1.
        """
        self._check_num_reqs(num_reqs)
        if positions.shape[0] > self.max_num_batched_tokens:
            raise ValueError(
                f"positions has {positions.shape[0]} tokens, more than max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )
        return compute_slot_mapping(
            self.block_table,
            query_start_loc[: num_reqs + 1].to(self.device, torch.int32),
            positions.to(self.device),
            self.kernel_block_size,
            dcp_world_size=self.dcp_world_size,
            dcp_rank=self.dcp_rank,
            interleave=self.interleave,
            out=self.slot_mapping,
        )

    def get_device_tensor(self, num_reqs: int | None = None) -> torch.Tensor:
        """The device table (its first `num_reqs` rows when given), as the attention kernel reads it."""
        return self.block_table if num_reqs is None else self.block_table[:num_reqs]

    def get_cpu_tensor(self) -> torch.Tensor:
        return self.block_table_cpu

    def row(self, row_idx: int) -> list[int]:
        """The valid kernel block ids of row `row_idx`."""
        self._check_row("row_idx", row_idx)
        return self.block_table_np[row_idx, : self.num_blocks_per_row[row_idx]].tolist()

    def _check_row(self, name: str, row_idx: int) -> None:
        if not 0 <= row_idx < self.max_num_reqs:
            raise ValueError(f"{name} {row_idx} is outside the table's rows [0, {self.max_num_reqs})")

    def _check_num_reqs(self, num_reqs: int) -> None:
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs {num_reqs} is outside [0, max_num_reqs {self.max_num_reqs}]")


class MultiGroupBlockTable:
    """One `BlockTable` per KV-cache group; row operations apply to every group.

    Each group's width is `cdiv(max_model_len, block_size * dcp_world_size)` blocks, rounded up to a
    multiple of `128 / gcd(128, block_size)`.
    """

    def __init__(
        self,
        block_sizes: Sequence[int],
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str = "cpu",
        pin_memory: bool | None = None,
        kernel_block_sizes: Sequence[int] | None = None,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        interleave: int = 1,
    ) -> None:
        if not block_sizes:
            raise ValueError("block_sizes must name at least one KV-cache group")
        check_positive("max_model_len", max_model_len)
        kernel_block_sizes = list(block_sizes) if kernel_block_sizes is None else list(kernel_block_sizes)
        if len(kernel_block_sizes) != len(block_sizes):
            raise ValueError(
                f"kernel_block_sizes has {len(kernel_block_sizes)} entries for {len(block_sizes)} groups"
            )
        self.block_tables: list[BlockTable] = []
        for block_size, kernel_block_size in zip(block_sizes, kernel_block_sizes, strict=True):
            check_positive("block_size", block_size)
            width = -(-max_model_len // (block_size * dcp_world_size))
            align = 128 // math.gcd(128, block_size)
            width = -(-width // align) * align
            self.block_tables.append(
                BlockTable(
                    block_size,
                    max_num_reqs,
                    width,
                    max_num_batched_tokens,
                    device=device,
                    pin_memory=pin_memory,
                    kernel_block_size=kernel_block_size,
                    dcp_world_size=dcp_world_size,
                    dcp_rank=dcp_rank,
                    interleave=interleave,
                )
            )

    def append_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        """Append one list of block ids per group (the allocator's `get_block_ids()` order)."""
        self._check_groups(block_ids)
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.append_row(ids, row_idx)

    def add_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        self._check_groups(block_ids)
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        for table in self.block_tables:
            table.clear_row(row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.swap_row(src, tgt)

    def commit(self, num_reqs: int) -> None:
        for table in self.block_tables:
            table.commit(num_reqs)

    def compute_slot_mapping(
        self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor
    ) -> list[torch.Tensor]:
        """One slot mapping per group (see `BlockTable.compute_slot_mapping`)."""
        return [table.compute_slot_mapping(num_reqs, query_start_loc, positions) for table in self.block_tables]

    def __getitem__(self, group_idx: int) -> BlockTable:
        return self.block_tables[group_idx]

    def __len__(self) -> int:
        return len(self.block_tables)

    def _check_groups(self, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.block_tables):
            raise ValueError(
                f"block_ids has {len(block_ids)} groups but the table has {len(self.block_tables)} KV-cache groups"
            )
