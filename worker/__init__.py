"""Ray-managed workers: the engine, the ranks of its pool, and the kernels they run.

    engine (scheduler: one allocator Step per step, step_plan, request) -> StepBatch (batch) -> every rank
      actor (a Ray actor per DCP rank, or LocalWorkers) -> runner (block_table, KV caches) -> model + kernels
    llm: `LLM` runs Hugging Face checkpoints on this engine (hf/: their own modules, our paged attention)
    deploy/ brings pools up on a Ray cluster; demo is `make run`.
"""

from __future__ import annotations

_LAZY = {"LLM": "worker.llm", "RequestOutput": "worker.llm", "CompletionOutput": "worker.llm",
         "SamplingParams": "worker.sampling"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    # Lazy: `worker.deploy`, the demo and the kernels load without transformers.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
