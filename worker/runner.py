"""One DCP rank's model execution: block table, paged K/V caches, and the forward pass of a `StepBatch`.

    StepBatch -> row edits (BlockTable), copy-on-write copies -> slot mapping -> per layer: cache write,
      paged attention (kernels or their torch twins), DCP merge -> logits of the tokens that sample

No Ray and no torch.distributed here: the actor wraps a `ModelRunner` and injects the all-gather that
merges the DCP ranks' partial attention, so tests can run several ranks in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from worker import kernels
from worker.batch import RowUpdate, StepBatch
from worker.block_table import BlockTable
from worker.kernels import reference
from worker.model import ModelConfig, TinyTransformer

# Returns every rank's tensor, stacked in rank order: `[W, *t.shape]` on t's device.
AllGather = Callable[[torch.Tensor], torch.Tensor]

BACKENDS: dict[str, ModuleType] = {"triton": kernels, "torch": reference}


class ModelRunner:
    """Executes scheduler steps of a `TinyTransformer` on this rank's shard of a paged KV cache.

    Args:
        block_size: per-rank block size; an allocator block spans `block_size * dcp_world_size` tokens.
        max_num_blocks_per_req: block-table row width in allocator blocks.
        backend: "triton" (`worker.kernels`; on CPU the Triton interpreter) or "torch" (their twins in
            `worker.kernels.reference`).
        all_gather: with `dcp_world_size > 1`, called twice per layer (partial out, then its LSE) in the
            same order on every rank; must return all ranks' tensors stacked in rank order.
        device: where weights and caches live (default: CUDA when available).
        num_threads: when given, `torch.set_num_threads(num_threads)` (process-wide).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        interleave: int = 1,
        backend: str = "torch",
        all_gather: AllGather | None = None,
        device: torch.device | str | None = None,
        num_threads: int | None = None,
    ) -> None:
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
        self.config = model_config
        self.block_size = block_size
        self.dcp_world_size = dcp_world_size
        self.dcp_rank = dcp_rank
        self.interleave = interleave
        self.max_num_batched_tokens = max_num_batched_tokens
        self._all_gather = all_gather

        self.block_table = BlockTable(
            block_size,
            max_num_reqs,
            max_num_blocks_per_req,
            max_num_batched_tokens,
            device=self.device,
            dcp_world_size=dcp_world_size,
            dcp_rank=dcp_rank,
            interleave=interleave,
        )
        self.model = TinyTransformer(model_config, device=self.device)
        shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_size)
        self.key_caches = [
            torch.zeros(shape, dtype=model_config.dtype, device=self.device) for _ in range(model_config.num_layers)
        ]
        self.value_caches = [
            torch.zeros(shape, dtype=model_config.dtype, device=self.device) for _ in range(model_config.num_layers)
        ]

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's K and V of `block_ids`, per layer (CPU copies: a cross-pool transfer's payload)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.key_caches[0].device)
        return [(k.index_select(0, index).cpu(), v.index_select(0, index).cpu())
                for k, v in zip(self.key_caches, self.value_caches)]

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes blocks read from a pool with the same layout (same rank) into `block_ids`."""
        if len(data) != len(self.key_caches):
            raise ValueError(f"transfer payload has {len(data)} layers, this pool {len(self.key_caches)}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.key_caches[0].device)
        for (k, v), key_cache, value_cache in zip(data, self.key_caches, self.value_caches):
            if k.shape[1:] != key_cache.shape[1:] or k.shape[0] != len(block_ids):
                raise ValueError(f"transfer payload of shape {tuple(k.shape)} does not fit blocks "
                                 f"{tuple(key_cache.shape[1:])} x {len(block_ids)}")
            key_cache.index_copy_(0, index, k.to(key_cache))
            value_cache.index_copy_(0, index, v.to(value_cache))

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Apply the batch's block-table edits and copies, run the forward pass, return fp32 logits
        `[len(batch.logits_indices), vocab]` in `logits_indices` order."""
        self._check_batch(batch)
        table = self.block_table
        for row in batch.clear_rows:
            table.clear_row(row)
        for update in batch.row_updates:
            self._apply_row_update(update)
        if batch.copies:
            pairs = torch.tensor(batch.copies, dtype=torch.int64, device=self.device).reshape(-1, 2)
            self._ops.copy_blocks(self.key_caches, self.value_caches, pairs)
        vocab = self.config.vocab_size
        if batch.num_tokens == 0:
            return torch.empty((0, vocab), dtype=torch.float32, device=self.device)
        self._check_rows_cover(batch)
        if batch.rows:
            table.commit(max(batch.rows) + 1)

        dev = self.device
        input_ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=dev)
        query_start_loc = torch.tensor(batch.query_start_loc, dtype=torch.int32, device=dev)
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev)
        # Kernel row i is request i of the batch, wherever its table row sits.
        step_table = table.get_device_tensor()[torch.tensor(batch.rows, dtype=torch.int64, device=dev)]
        slot_mapping = self._ops.compute_slot_mapping(
            step_table,
            query_start_loc,
            positions,
            self.block_size,
            dcp_world_size=self.dcp_world_size,
            dcp_rank=self.dcp_rank,
            interleave=self.interleave,
            out=table.slot_mapping,
        )

        def attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            key_cache, value_cache = self.key_caches[layer_idx], self.value_caches[layer_idx]
            self._ops.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
            merge = self.dcp_world_size > 1
            result = self._ops.paged_attention(
                q,
                key_cache,
                value_cache,
                step_table,
                query_start_loc,
                seq_lens,
                self.model.scale,
                return_lse=merge,
                dcp_world_size=self.dcp_world_size,
                dcp_rank=self.dcp_rank,
                interleave=self.interleave,
            )
            if not merge:
                return result
            out, lse = result
            out, _ = self._ops.merge_attn_states(self._all_gather(out), self._all_gather(lse))
            return out

        hidden = self.model.forward(input_ids, positions, attention)
        rows = torch.tensor(batch.logits_indices, dtype=torch.int64, device=dev)
        return self.model.logits(hidden[rows])

    def _apply_row_update(self, update: RowUpdate) -> None:
        table = self.block_table
        if update.set_blocks is not None:
            table.add_row(update.set_blocks, update.row)
        table.append_row(update.append_blocks, update.row)
        if update.replace:
            # BlockTable appends only; a copy-on-write swap rebuilds the row (a few ints on the host).
            ids = table.row(update.row)
            for index, block_id in update.replace:
                if not 0 <= index < len(ids):
                    raise ValueError(f"row {update.row}: replace index {index} is outside its {len(ids)} blocks {ids}")
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
        if any(not 0 <= r < self.block_table.max_num_reqs for r in batch.rows):
            problems.append(f"rows {batch.rows} must lie in [0, max_num_reqs {self.block_table.max_num_reqs})")
        if any(not 0 <= i < num_tokens for i in batch.logits_indices):
            problems.append(f"logits_indices must lie in [0, {num_tokens}), got {batch.logits_indices}")
        if problems:
            raise ValueError("malformed StepBatch: " + "; ".join(problems))

    def _check_rows_cover(self, batch: StepBatch) -> None:
        """Every sequence must fit the blocks its row holds (else attention would read block 0's slots)."""
        tokens_per_block = self.block_size * self.dcp_world_size
        have = self.block_table.num_blocks_per_row[np.asarray(batch.rows, dtype=np.int64)] * tokens_per_block
        short = [(row, n, int(h)) for row, n, h in zip(batch.rows, batch.seq_lens, have, strict=True) if n > h]
        if short:
            row, seq_len, capacity = short[0]
            raise ValueError(
                f"row {row} holds blocks for {capacity} tokens but its sequence is {seq_len} long "
                f"({len(short)} such rows); append blocks before scheduling the tokens"
            )
