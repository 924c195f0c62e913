"""`from worker import LLM, SamplingParams`: Hugging Face checkpoints generating on kvservice's paged KV,
with vLLM's names (`LLM`, `SamplingParams`, `RequestOutput`).

    LLM.generate -> Engine (continuous batching, one allocator Step per step) -> workers (one per DCP rank)
      -> HFModelRunner (the checkpoint's own modules, paged attention); the allocator owns the KV memory
`LLM` starts what it needs (a `kvservice serve` child with its embedded Redis, unless given `allocator`;
Ray ranks when `dcp > 1`) and `close()` stops it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import worker.hf  # noqa: F401  - first: sets TRITON_INTERPRET before transformers imports triton
from kvservice.client import KVServiceClient
from kvservice.launch import ServeProcess, start_serve
from worker.actor import LocalWorkers, PoolLayout, RayWorkers, default_backend
from worker.engine import Engine, EngineConfig
from worker.hf.arch import load_model_spec
from worker.ray_local import init_local
from worker.request import EngineRequest
from worker.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

# An LLM idle this long opens a fresh session before it generates again: its lease (default 30 s) may
# have lapsed. It holds no requests between generate() calls, so nothing is lost.
SESSION_IDLE_S = 10.0
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # per rank, when num_blocks is not given
_POOL_IDS = itertools.count()


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: None
    finish_reason: str | None  # "stop" or "length"
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS and length)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache


class LLM:
    """A `save_pretrained` directory served by kvservice.

    Args:
        model: the directory (config.json + safetensors; a tokenizer there makes string prompts work).
        num_blocks: the pool's blocks, the null block included (default: what `max_num_seqs` sequences
            of `max_model_len` need, within `kv_cache_memory_bytes` per rank).
        block_size: tokens per block and rank.
        dcp: decode-context-parallel ranks: full-attention layers' KV is sharded across them, sliding-window
            layers' KV is kept whole on each (vLLM's layout).
        backend: "triton" or "torch" attention (default: Triton with CUDA, the torch twin on CPU).
        allocator: "host:port" of a running allocator (default: start `kvservice serve` here).
        max_model_len: default the config's max_position_embeddings.
        distributed_executor_backend: "uni" (ranks in this process) or "ray" (a Ray actor per rank);
            default "uni" for one rank, "ray" for more (vLLM's choice).
    """

    def __init__(self, model: str | Path, num_blocks: int | None = None, block_size: int = 16, dcp: int = 1,
                 backend: str | None = None, allocator: str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True, *,
                 dtype: str = "auto", distributed_executor_backend: str | None = None,
                 kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY, token: str | None = None,
                 pool_id: str | None = None) -> None:
        self.spec = spec = load_model_spec(model, dtype)
        max_model_len = max_model_len or spec.max_position_embeddings
        if max_model_len > spec.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"{spec.max_position_embeddings}")
        executor = distributed_executor_backend or ("uni" if dcp == 1 else "ray")
        if executor not in ("uni", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'uni' or 'ray', got {executor!r}")
        groups = spec.kv_cache_groups(block_size)
        if num_blocks is None:
            num_blocks = self._default_num_blocks(block_size, dcp, max_model_len, max_num_seqs, kv_cache_memory_bytes)
        self._data_dir: str | None = None
        self._serve: ServeProcess | None = None
        self._workers = None
        self._started_ray = False
        self.config = EngineConfig(pool_id=pool_id or f"llm-{os.getpid()}-{next(_POOL_IDS)}", num_blocks=num_blocks,
                                   block_size=block_size, dcp_world_size=dcp, max_model_len=max_model_len,
                                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   epoch=time.time_ns() // 1_000_000, enable_prefix_caching=enable_prefix_caching,
                                   kv_cache_groups=groups, eos_token_ids=spec.eos_token_ids)
        try:
            target = allocator or self._start_allocator()
            layout = PoolLayout(spec, num_blocks, block_size, self.config.max_num_rows,
                                self.config.max_num_blocks_per_req, max_num_batched_tokens, dcp,
                                backend=backend or default_backend())
            self.config.kv_layout = layout.kv_layout
            self._workers = self._start_workers(layout, executor)
            self.client = KVServiceClient(target, token, client_name=f"llm-{self.config.pool_id}")
            self.engine = Engine(self.client, self._workers, self.config)
        except BaseException:
            self.close()
            raise
        self.tokenizer = _load_tokenizer(spec.path)
        self._last_call = time.monotonic()

    def _default_num_blocks(self, block_size: int, dcp: int, max_model_len: int, max_num_seqs: int,
                            budget: int) -> int:
        spec = self.spec
        tensors = max(spec.layer_groups.count(g) for g in range(len(spec.sliding_windows)))
        bytes_per_block = 2 * tensors * block_size * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize
        per_seq = sum(-(-max_model_len // (block_size * (dcp if w is None else 1))) for w in spec.sliding_windows)
        return max(2, min(max_num_seqs * per_seq, budget // bytes_per_block)) + 1

    def _start_allocator(self) -> str:
        self._data_dir = tempfile.mkdtemp(prefix="kvservice-llm-")
        self._serve = start_serve(["--port", "0", "--data-dir", self._data_dir, "--private"])
        return self._serve.target

    def _start_workers(self, layout: PoolLayout, executor: str):
        if executor == "uni":
            return LocalWorkers(layout)
        import ray
        if not ray.is_initialized():
            init_local()
            self._started_ray = True
        return RayWorkers(layout, num_cpus=min(1.0, (os.cpu_count() or 1) / layout.dcp_world_size))

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Completions of `prompts` (a list of token-id lists or strings, or one of them), in order.

        `sampling_params`: one for all prompts or one per prompt (default `SamplingParams()`: greedy, 16
        tokens). Strings need a tokenizer in the model directory. `use_tqdm`: report progress on stderr, a
        line each time another eighth of the prompts has finished.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        if time.monotonic() - self._last_call > SESSION_IDLE_S:
            self.client.open_session()
        texts, reqs = [], []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text, ids = self._prompt_ids(i, prompt)
            texts.append(text)
            reqs.append(self.engine.add_request(ids, p or SamplingParams()))
        try:
            self.engine.run(progress=Progress(reqs) if use_tqdm else None)
            families: dict[str, list[EngineRequest]] = {r.request_id: [r] for r in reqs}
            for r in self.engine.finished:
                if r.parent is not None and r.parent.request_id in families:
                    families[r.parent.request_id].append(r)
        finally:
            self.engine.finished.clear()
            self._last_call = time.monotonic()
        return [self._output(r, text, families[r.request_id]) for r, text in zip(reqs, texts)]

    def _prompt_ids(self, i: int, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string but {self.spec.path} has no tokenizer; pass token ids")
            return prompt, self.tokenizer(prompt).input_ids
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
        if not ids or bad:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids in [0, vocab_size "
                             f"{self.spec.vocab_size}), got {bad[:3] if bad else ids}")
        return None, ids

    def _output(self, req: EngineRequest, text: str | None, family: list[EngineRequest]) -> RequestOutput:
        outputs = []
        for index, r in enumerate(sorted(family, key=lambda s: s.seed)):  # child k was seeded seed + k
            decoded = self.tokenizer.decode(r.output, skip_special_tokens=True) if self.tokenizer else ""
            outputs.append(CompletionOutput(index, decoded, r.output, None, None, r.finish_reason, r.stop_reason))
        return RequestOutput(req.request_id, text, req.tokens[:req.num_prompt_tokens], outputs, True,
                             max(req.hit_tokens, 0))

    @property
    def stats(self):
        return self.engine.stats

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops what this LLM started: its workers, its allocator (and Redis), Ray if it started it."""
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        if isinstance(self._workers, RayWorkers):
            self._workers.shutdown()
        self._workers = None
        if self._started_ray:
            from worker.ray_local import shutdown
            shutdown()
            self._started_ray = False
        if self._serve is not None:
            self._serve.stop(timeout_s=20)
            self._serve = None
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _load_tokenizer(path: str):
    """The directory's tokenizer, or None when it has none."""
    if not any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class Progress:
    """`LLM.generate(use_tqdm=True)`: "N/M prompts finished" on stderr, at every eighth of them (a CPU run of
    the Triton interpreter takes a while: the user sees it is moving)."""

    def __init__(self, reqs: list[EngineRequest]) -> None:
        self.ids = {r.request_id for r in reqs}
        self.every = max(1, len(reqs) // 8)
        self.reported = 0
        self.start = time.perf_counter()

    def __call__(self, engine: Engine) -> None:
        done = sum(r.request_id in self.ids for r in engine.finished)
        if done >= self.reported + self.every or (done == len(self.ids) and done > self.reported):
            self.reported = done
            print(f"  {done}/{len(self.ids)} prompts finished ({engine.stats.steps} steps, "
                  f"{time.perf_counter() - self.start:.1f} s)", file=sys.stderr, flush=True)
