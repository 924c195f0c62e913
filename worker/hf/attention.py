"""The attention function a Hugging Face module calls when it runs on kvservice's paged KV.

    HF decoder layer (projections, RoPE, q/k norms: the model's own code) -> paged_attention_forward
      -> PagedRunner.attention (cache write into the layer's group, paged attention, DCP merge)
Registered with `transformers.AttentionInterface` under ATTN_IMPLEMENTATION; transformers then builds no
mask of its own (an implementation it has no mask function for), and each call finds the step in its kwargs.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "kvservice_paged"
STEP_KWARG = "kvservice_step"  # (PagedRunner, PagedStep), passed through the model's forward kwargs


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """q `[1, Hq, T, D]`, k/v `[1, Hkv, T, D]` of the step's tokens (all requests packed in one row) ->
    `[1, T, Hq, D]`, attending over each request's cached context."""
    step = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"attn_implementation {ATTN_IMPLEMENTATION!r} runs only inside a kvservice worker "
                           f"(it needs the step's block tables); load the model with 'sdpa' or 'eager' elsewhere")
    runner, paged_step = step
    if kwargs.get("softcap") is not None:
        raise ValueError(f"layer {module.layer_idx}: attention soft-capping {kwargs['softcap']} is not computed")
    layer = module.layer_idx
    window = kwargs.get("sliding_window")
    expected = runner.kv.sliding_windows[runner.kv.layer_groups[layer]]
    if window != expected:  # the group this layer's blocks come from must be the layer's own attention
        raise ValueError(f"layer {layer} attends with sliding_window={window}, its KV-cache group with {expected}")
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return runner.attention(paged_step, layer, q, k, v, scale)[None], None


def register() -> str:
    """Registers the paged attention (idempotent); returns the name to load models with."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
