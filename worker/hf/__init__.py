"""Hugging Face decoder models on kvservice's paged KV: the model's own modules, our attention.

    arch (config -> ModelSpec, KV-cache groups, refusals) -> runner (HFModelRunner: one rank)
      -> attention (the function transformers calls per layer) -> worker.paged (caches, kernels)
"""

import worker.kernels  # noqa: F401  - first: sets TRITON_INTERPRET before transformers' models import triton
