"""One DCP rank running a Hugging Face decoder model on its shard of the pool's paged KV.

    StepBatch -> PagedRunner (rows per group, copies, slot mappings) -> the HF model's own forward, all
      requests packed in one row at their positions -> paged_attention_forward per layer -> logits
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM

from worker.hf import attention
from worker.hf.arch import ModelSpec
from worker.paged import AllGather, KVLayout, PagedRunner, PagedStep


def load_model(spec: ModelSpec, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The checkpoint's weights in its own modeling code, attention through the paged path."""
    transformers.utils.logging.disable_progress_bar()  # one bar per rank and load says nothing useful
    model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=spec.dtype, attn_implementation=attention.register())
    return model.to(device).eval()


class HFModelRunner(PagedRunner):
    """Executes scheduler steps of a `save_pretrained` model; see `PagedRunner` for the arguments."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, max_num_reqs: int,
                 max_num_blocks_per_req: int, max_num_batched_tokens: int, dcp_world_size: int = 1,
                 dcp_rank: int = 0, interleave: int = 1, backend: str = "torch", all_gather: AllGather | None = None,
                 device: torch.device | str | None = None, num_threads: int | None = None) -> None:
        kv = KVLayout(spec.layer_groups, spec.sliding_windows, spec.num_kv_heads, spec.head_size, spec.dtype)
        super().__init__(kv, spec.vocab_size, num_blocks, block_size, max_num_reqs, max_num_blocks_per_req,
                         max_num_batched_tokens, dcp_world_size, dcp_rank, interleave, backend, all_gather, device,
                         num_threads)
        self.spec = spec
        self.model = load_model(spec, self.device)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                         logits_to_keep=logits_indices, **{attention.STEP_KWARG: (self, step)})
        return out.logits[0].float()
