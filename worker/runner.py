"""One DCP rank running the tiny transformer (`worker.model`) on its shard of a paged KV cache.

    StepBatch -> PagedRunner (rows, copies, slot mappings) -> TinyTransformer.forward, attention per layer
      through PagedRunner.attention -> logits of the tokens that sample
No Ray and no torch.distributed here: the actor wraps a runner and injects the all-gather that merges the
DCP ranks' partial attention, so tests can run several ranks in one process.
"""

from __future__ import annotations

import torch

from worker.model import ModelConfig, TinyTransformer
from worker.paged import BACKENDS, AllGather, KVLayout, PagedRunner, PagedStep

__all__ = ["BACKENDS", "AllGather", "ModelRunner"]


class ModelRunner(PagedRunner):
    """Executes scheduler steps of a `TinyTransformer` (one full-attention KV-cache group); see
    `PagedRunner` for the arguments."""

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
        c = model_config
        kv = KVLayout((0,) * c.num_layers, (None,), c.num_kv_heads, c.head_size, c.dtype)
        super().__init__(kv, c.vocab_size, num_blocks, block_size, max_num_reqs, max_num_blocks_per_req,
                         max_num_batched_tokens, dcp_world_size, dcp_rank, interleave, backend, all_gather, device,
                         num_threads)
        self.config = model_config
        self.model = TinyTransformer(model_config, device=self.device)

    @property
    def block_table(self):
        """The one group's block table."""
        return self.block_tables[0]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        scale = self.model.scale

        def attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attention(step, layer_idx, q, k, v, scale)

        hidden = self.model.forward(input_ids, positions, attention)
        return self.model.logits(hidden[logits_indices])
