"""One rank's paged KV state, whatever model runs on it: a block table per KV-cache group, the K/V cache
tensors, and the per-layer attention over them.

    StepBatch -> PagedRunner.execute: row edits, copy-on-write copies, slot mappings -> PagedStep
      -> subclass._forward (TinyTransformer or a Hugging Face module) -> attention(step, layer, q, k, v)
Block ids are the pool's: a block belongs to one group at a time, so the layers of different groups share
cache tensors (tensor j holds the j-th layer of every group, as vLLM lays out hybrid models).
Under DCP (vLLM's `dcp_sharded`, per group): a full-attention group is sharded (an allocator block spans
`block_size * W` tokens, each rank stores its `block_size` of them, partial attention merged by LSE); a
sliding-window group is replicated (a block spans `block_size` tokens, every rank stores all of them and
attends over the whole window itself, nothing merged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from worker import kernels
from worker.batch import RowUpdate, StepBatch
from worker.block_table import BlockTable
from worker.kernels import torch_batched

# Returns every rank's tensor, stacked in rank order: `[W, *t.shape]` on t's device.
AllGather = Callable[[torch.Tensor], torch.Tensor]

BACKENDS: dict[str, ModuleType] = {"triton": kernels, "torch": torch_batched}


@dataclass(slots=True, frozen=True)
class KVLayout:
    """How a model's layers map onto the pool's KV-cache groups and this rank's cache tensors."""

    layer_groups: tuple[int, ...]  # layer -> KV-cache group
    sliding_windows: tuple[int | None, ...]  # group -> window (None: full attention)
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        used = set(self.layer_groups)
        if used != set(range(len(self.sliding_windows))):
            raise ValueError(f"layer groups {sorted(used)} must be exactly the groups "
                             f"0..{len(self.sliding_windows) - 1}")

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    @property
    def dcp_sharded(self) -> tuple[bool, ...]:
        """group -> whether DCP shards its tokens across ranks (full attention) or every rank keeps them
        all (a sliding window: vLLM's layout, the window is short)."""
        return tuple(w is None for w in self.sliding_windows)

    @property
    def layer_tensors(self) -> tuple[int, ...]:
        """layer -> cache tensor: its position among its group's layers."""
        seen = [0] * self.num_groups
        out = []
        for g in self.layer_groups:
            out.append(seen[g])
            seen[g] += 1
        return tuple(out)

    @property
    def num_tensors(self) -> int:
        return max(self.layer_tensors) + 1


@dataclass(slots=True)
class PagedStep:
    """What attention reads for one forward pass on this rank (kernel row i = request i of the batch)."""

    tables: list[torch.Tensor]  # per group: int32 [R, max_num_blocks_per_req]
    slot_mappings: list[torch.Tensor]  # per group: int64 [T], -1 where another rank owns the token
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]


class PagedRunner:
    """Executes scheduler steps on this rank's shard of a paged KV cache; subclasses run the model.

    Args:
        block_size: per-rank block size; an allocator block of a DCP-sharded group spans
            `block_size * dcp_world_size` tokens, of a replicated group `block_size`.
        max_num_blocks_per_req: block-table row width in allocator blocks of a sharded group (a
            replicated group's rows are `dcp_world_size` times wider).
        backend: "triton" (`worker.kernels`; on CPU the Triton interpreter) or "torch" (their twins in
            `worker.kernels.torch_batched`: the reference twins, attention batched).
        all_gather: with `dcp_world_size > 1`, called twice per layer (partial out, then its LSE) in the
            same order on every rank; must return all ranks' tensors stacked in rank order.
        device: where weights and caches live (default: CUDA when available).
        num_threads: when given, `torch.set_num_threads(num_threads)` (process-wide).
    """

    def __init__(self, kv: KVLayout, vocab_size: int, num_blocks: int, block_size: int, max_num_reqs: int,
                 max_num_blocks_per_req: int, max_num_batched_tokens: int, dcp_world_size: int = 1,
                 dcp_rank: int = 0, interleave: int = 1, backend: str = "torch", all_gather: AllGather | None = None,
                 device: torch.device | str | None = None, num_threads: int | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(BACKENDS)}")
        if dcp_world_size > 1 and all_gather is None:
            raise ValueError(f"dcp_world_size {dcp_world_size} needs an all_gather callable to merge attention")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.backend = backend
        self._ops = BACKENDS[backend]
        self.kv = kv
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.dcp_world_size = dcp_world_size
        self.dcp_rank = dcp_rank
        self.interleave = interleave
        self.max_num_batched_tokens = max_num_batched_tokens
        self._all_gather = all_gather
        self._layer_tensors = kv.layer_tensors
        # group -> (world, rank, interleave) its tokens are spread over: a replicated group is one "rank".
        self._group_dcp = [(dcp_world_size, dcp_rank, interleave) if sharded else (1, 0, 1)
                           for sharded in kv.dcp_sharded]
        self.block_tables = [
            BlockTable(block_size, max_num_reqs, max_num_blocks_per_req * (dcp_world_size // world),
                       max_num_batched_tokens, device=self.device, dcp_world_size=world, dcp_rank=rank,
                       interleave=inter)
            for world, rank, inter in self._group_dcp
        ]
        shape = (num_blocks, block_size, kv.num_kv_heads, kv.head_size)
        self.key_caches = [torch.zeros(shape, dtype=kv.dtype, device=self.device) for _ in range(kv.num_tensors)]
        self.value_caches = [torch.zeros(shape, dtype=kv.dtype, device=self.device) for _ in range(kv.num_tensors)]

    @property
    def max_num_reqs(self) -> int:
        return self.block_tables[0].max_num_reqs

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[len(logits_indices), vocab]` of the step's tokens; attention through `attention`."""
        raise NotImplementedError

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Apply the batch's block-table edits and copies, run the forward pass, return fp32 logits
        `[len(batch.logits_indices), vocab]` in `logits_indices` order."""
        self._check_batch(batch)
        for row in batch.clear_rows:
            for table in self.block_tables:
                table.clear_row(row)
        for update in batch.row_updates:
            self._apply_row_update(update)
        if batch.copies:
            pairs = torch.tensor(batch.copies, dtype=torch.int64, device=self.device).reshape(-1, 2)
            self._ops.copy_blocks(self.key_caches, self.value_caches, pairs)
        if batch.num_tokens == 0:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        self._check_rows_cover(batch)
        dev = self.device
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=dev)
        query_start_loc = torch.tensor(batch.query_start_loc, dtype=torch.int32, device=dev)
        rows = torch.tensor(batch.rows, dtype=torch.int64, device=dev)
        tables, slot_mappings = [], []
        for table, (world, rank, inter) in zip(self.block_tables, self._group_dcp):
            table.commit(max(batch.rows) + 1)
            step_table = table.get_device_tensor()[rows]  # kernel row i is request i, wherever its row sits
            tables.append(step_table)
            slot_mappings.append(self._ops.compute_slot_mapping(
                step_table, query_start_loc, positions, self.block_size, dcp_world_size=world, dcp_rank=rank,
                interleave=inter, out=table.slot_mapping))
        step = PagedStep(tables, slot_mappings, query_start_loc,
                         torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev))
        input_ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=dev)
        logits_indices = torch.tensor(batch.logits_indices, dtype=torch.int64, device=dev)
        return self._forward(input_ids, positions, step, logits_indices)

    def attention(self, step: PagedStep, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
        """Writes the step's K/V `[T, Hkv, D]` of `layer_idx` into its cache, attends q `[T, Hq, D]` over the
        layer's group (its sliding window), merges the DCP ranks' partials of a sharded group (a replicated
        group's output is already whole on every rank); out `[T, Hq, D]`."""
        group = self.kv.layer_groups[layer_idx]
        key_cache = self.key_caches[self._layer_tensors[layer_idx]]
        value_cache = self.value_caches[self._layer_tensors[layer_idx]]
        self._ops.reshape_and_cache(k, v, key_cache, value_cache, step.slot_mappings[group])
        world, rank, inter = self._group_dcp[group]
        merge = world > 1
        result = self._ops.paged_attention(
            q, key_cache, value_cache, step.tables[group], step.query_start_loc, step.seq_lens, scale,
            sliding_window=self.kv.sliding_windows[group], return_lse=merge, dcp_world_size=world,
            dcp_rank=rank, interleave=inter)
        if not merge:
            return result
        out, lse = result
        out, _ = self._ops.merge_attn_states(self._all_gather(out), self._all_gather(lse))
        return out

    # ---- transfers -----------------------------------------------------------------------------
    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's K and V of `block_ids`, per cache tensor (CPU copies: a cross-pool transfer's payload)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return [(k.index_select(0, index).cpu(), v.index_select(0, index).cpu())
                for k, v in zip(self.key_caches, self.value_caches)]

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes blocks read from a pool with the same layout (same rank) into `block_ids`."""
        if len(data) != len(self.key_caches):
            raise ValueError(f"transfer payload has {len(data)} cache tensors, this pool {len(self.key_caches)}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for (k, v), key_cache, value_cache in zip(data, self.key_caches, self.value_caches):
            if k.shape[1:] != key_cache.shape[1:] or k.shape[0] != len(block_ids):
                raise ValueError(f"transfer payload of shape {tuple(k.shape)} does not fit blocks "
                                 f"{tuple(key_cache.shape[1:])} x {len(block_ids)}")
            key_cache.index_copy_(0, index, k.to(key_cache))
            value_cache.index_copy_(0, index, v.to(value_cache))

    # ---- checks and row edits ------------------------------------------------------------------
    def _apply_row_update(self, update: RowUpdate) -> None:
        for name, lists in (("set_blocks", update.set_blocks), ("append_blocks", update.append_blocks)):
            if lists and len(lists) != len(self.block_tables):
                raise ValueError(f"row {update.row}: {name} has {len(lists)} groups, the pool "
                                 f"{len(self.block_tables)}")
        for g, table in enumerate(self.block_tables):
            if update.set_blocks is not None:
                table.add_row(update.set_blocks[g], update.row)
            if update.append_blocks:
                table.append_row(update.append_blocks[g], update.row)
        if update.replace:
            # BlockTable appends only; a copy-on-write swap rebuilds the row (a few ints on the host).
            for g, table in enumerate(self.block_tables):
                swaps = [(index, block_id) for group, index, block_id in update.replace if group == g]
                if not swaps:
                    continue
                ids = table.row(update.row)
                for index, block_id in swaps:
                    if not 0 <= index < len(ids):
                        raise ValueError(f"row {update.row}: replace index {index} is outside its {len(ids)} "
                                         f"blocks {ids} (group {g})")
                    ids[index] = block_id
                table.add_row(ids, update.row)

    def _check_batch(self, batch: StepBatch) -> None:
        num_tokens, num_reqs = batch.num_tokens, len(batch.rows)
        problems = []
        if len(batch.positions) != num_tokens:
            problems.append(f"{len(batch.positions)} positions for {num_tokens} input_ids")
        if len(batch.query_start_loc) != num_reqs + 1:
            problems.append(f"query_start_loc has {len(batch.query_start_loc)} entries for {num_reqs} rows")
        elif batch.query_start_loc[0] != 0 or batch.query_start_loc[-1] != num_tokens:
            problems.append(f"query_start_loc {batch.query_start_loc} must run from 0 to {num_tokens}")
        if len(batch.seq_lens) != num_reqs:
            problems.append(f"{len(batch.seq_lens)} seq_lens for {num_reqs} rows")
        if num_tokens > self.max_num_batched_tokens:
            problems.append(f"{num_tokens} tokens exceed max_num_batched_tokens {self.max_num_batched_tokens}")
        if any(not 0 <= r < self.max_num_reqs for r in batch.rows):
            problems.append(f"rows {batch.rows} must lie in [0, max_num_reqs {self.max_num_reqs})")
        if any(not 0 <= i < num_tokens for i in batch.logits_indices):
            problems.append(f"logits_indices must lie in [0, {num_tokens}), got {batch.logits_indices}")
        if problems:
            raise ValueError("malformed StepBatch: " + "; ".join(problems))

    def _check_rows_cover(self, batch: StepBatch) -> None:
        """Every sequence must fit the blocks its rows hold (else attention would read block 0's slots)."""
        rows = np.asarray(batch.rows, dtype=np.int64)
        for g, table in enumerate(self.block_tables):
            have = table.num_blocks_per_row[rows] * (self.block_size * self._group_dcp[g][0])
            short = [(row, n, int(h)) for row, n, h in zip(batch.rows, batch.seq_lens, have, strict=True) if n > h]
            if short:
                row, seq_len, capacity = short[0]
                raise ValueError(
                    f"row {row} holds blocks for {capacity} tokens of group {g} but its sequence is {seq_len} long "
                    f"({len(short)} such rows); append blocks before scheduling the tokens"
                )
