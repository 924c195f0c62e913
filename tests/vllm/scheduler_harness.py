"""Parity harness: vLLM 0.33.0's stock scheduler and the kvservice-backed one, side by side.

Both get the same VllmConfig (vLLM's defaults but for the sizes a workload picks), the same request stream
and the same fake model outputs (built as vLLM's tests/v1/core/test_scheduler.py builds them: one sampled
token per request that finished its prefill, none for a prefill chunk). After every step the two
SchedulerOutputs must agree: scheduled tokens per request, new requests with their block ids and prefix
hits, cached requests' new block ids and computed tokens, preemptions, finished ids; and the prefix-cache
stats. With async scheduling the engine's order is kept: step k+1 is scheduled before step k's output.

Runs in the project's vLLM environment only (make vllm-env); used by tests/vllm/test_vllm_scheduler.py and
bench/vllm_scheduler_parity.py.
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as StockAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as StockScheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvservice.integrations.vllm import AsyncScheduler, Scheduler
from tests.vllm import parity_features as features

BLOCK = 16
VOCAB = 1000
EOS = 2
# A known architecture, no weights: the scheduler reads only the config (skip_tokenizer_init).
MODEL_CONFIG = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64,
                "num_attention_heads": 4, "num_hidden_layers": 2, "ffn_dim": 128, "vocab_size": 50272,
                "max_position_embeddings": 4096, "word_embed_proj_dim": 64, "torch_dtype": "float16",
                "do_layer_norm_before": True, "pad_token_id": 1, "bos_token_id": EOS, "eos_token_id": EOS}

init_none_hash(sha256)
_HASHERS = {}


def hasher(hash_block_size: int):
    """vLLM's request block hasher for this hash block size (one per size)."""
    if hash_block_size not in _HASHERS:
        _HASHERS[hash_block_size] = get_request_block_hasher(hash_block_size, sha256)
    return _HASHERS[hash_block_size]


def write_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return path


@dataclass(slots=True, frozen=True)
class Mode:
    """Which of vLLM's defaults a run keeps: async scheduling (AsyncScheduler) and the full-sequence
    admission gate (scheduler_reserve_full_isl)."""

    async_scheduling: bool = True
    full_sequence_gate: bool = True
    sliding_window: int = 0  # the one KV cache group's window (0: full attention)
    # KVCacheConfig.prefix_cache_retention_interval (None: dense; 0, what vLLM's engine sets: sparse, only
    # the blocks a hit at a replay boundary needs are cached)
    retention: int | None = None
    connector: str = ""  # "sync" / "async": a KV connector's external hits (parity_features.ParityConnector)
    spec_tokens: int = 0  # ngram speculative decoding, this many draft tokens, random acceptance
    replay: int = 0  # SWA bounded replay: a second, replayed sliding-window group with this window
    mamba: bool = False  # a hybrid model: a Mamba group ("align" cache mode) beside the attention group
    # ...whose prefill chunks export interior checkpoints (vLLM's Mamba2 layers: one checkpoint block, any
    # position); with spec_tokens the group has that many speculative blocks, as vLLM gives it
    mamba_checkpoints: bool = False
    # a second attention group of another kind beside the first: "rswa" (reference sliding window of 4
    # generated tokens), "sink" (attention sinks of one block) or "ring" (a circular buffer, one block a request)
    extra: str = ""
    # the requests' hash block size (vLLM's hash_block_size; 0: the block size). Below the block size, with a
    # Mamba group, prefix hits may end inside a block (vLLM's sub-block hits, their copy-on-write)
    hash_block: int = 0
    # decode context parallelism: attention groups' tokens sharded across this many ranks (their blocks span
    # BLOCK * dcp tokens), Mamba groups replicated (blocks of BLOCK * dcp tokens too, as the engine sizes them)
    dcp: int = 1
    # prefill context parallelism (vLLM's scheduler gives its KV-cache manager pcp_world_size 1 whatever it is)
    pcp: int = 1
    # an EAGLE drafter's attention group beside the target's (is_eagle_group), and vLLM's
    # enable_mamba_shared_prefix_checkpoint: with sub-block hits, Mamba states cached at shared-prefix junctions
    eagle_group: bool = False
    shared_prefix_checkpoint: bool = False

    @property
    def name(self) -> str:
        return (f"async {'on' if self.async_scheduling else 'off'}, "
                f"gate {'on' if self.full_sequence_gate else 'off'}"
                + (f", window {self.sliding_window}" if self.sliding_window else "")
                + (f", retention {self.retention}" if self.retention is not None else "")
                + (f", {self.connector} connector" if self.connector else "")
                + (f", ngram spec {self.spec_tokens}" if self.spec_tokens else "")
                + (f", replay {self.replay}" if self.replay else "")
                + (", mamba" if self.mamba else "")
                + (" with checkpoints" if self.mamba_checkpoints else "")
                + (f", {self.extra} group" if self.extra else "")
                + (f", hash block {self.hash_block}" if self.hash_block else "")
                + (f", dcp {self.dcp}" if self.dcp > 1 else "")
                + (f", pcp {self.pcp}" if self.pcp > 1 else "")
                + (", eagle group" if self.eagle_group else "")
                + (", shared-prefix checkpoints" if self.shared_prefix_checkpoint else ""))


DEFAULT = Mode()
# A window of 40 tokens leaves a block on other steps than those that allocate one (sync scheduling above all).
MODES = (DEFAULT, Mode(async_scheduling=False), Mode(full_sequence_gate=False), Mode(sliding_window=40),
         Mode(async_scheduling=False, sliding_window=40), Mode(sliding_window=40, retention=0))
# KV connectors (synchronous and asynchronous external hits; async scheduling defers block frees), ngram
# speculative decoding, SWA bounded replay, a hybrid Mamba model (not with this harness's connector: stock vLLM
# 0.33.0 itself raises "Cannot get 1 free blocks" on some workloads there), R-SWA and circular-buffer groups.
# (No attention-sink group: vLLM's own SinkFullAttentionManager cannot be built, a TypeError in vLLM.)
FEATURE_MODES = (Mode(connector="sync"), Mode(connector="async"), Mode(async_scheduling=False, connector="async"),
                 Mode(async_scheduling=False, spec_tokens=3), Mode(replay=32),
                 Mode(async_scheduling=False, replay=32, connector="sync"), Mode(mamba=True),
                 Mode(async_scheduling=False, mamba=True), Mode(mamba=True, mamba_checkpoints=True),
                 Mode(async_scheduling=False, mamba=True, mamba_checkpoints=True, spec_tokens=3),
                 Mode(extra="rswa"), Mode(async_scheduling=False, extra="rswa"), Mode(extra="ring"),
                 Mode(async_scheduling=False, extra="ring"),
                 # vLLM's default for Mamba groups: sparse retention (only semantic checkpoints cached), where a
                 # hit's shared-prefix boundary decides what is cached
                 Mode(mamba=True, retention=0), Mode(async_scheduling=False, mamba=True, mamba_checkpoints=True,
                                                     retention=0))
# Layouts that change the block geometry: sub-block prefix hits (a hybrid Mamba model hashing half-blocks: hits
# ending inside a block, their copy-on-write copies held until the step that copies is processed; with an EAGLE
# group, vLLM's shared-prefix checkpoints under sparse retention), decode
# context parallelism (attention blocks sharded across 2 ranks; a replicated Mamba group beside), and prefill
# context parallelism with it. Each needs an allocator at its hash block size (hash_block_size_of).
LAYOUT_MODES = (Mode(mamba=True, hash_block=BLOCK // 2),
                Mode(async_scheduling=False, mamba=True, mamba_checkpoints=True, spec_tokens=3, hash_block=BLOCK // 2),
                Mode(mamba=True, hash_block=BLOCK // 2, retention=0, eagle_group=True, shared_prefix_checkpoint=True),
                Mode(dcp=2), Mode(async_scheduling=False, dcp=2, spec_tokens=3), Mode(dcp=2, mamba=True),
                Mode(async_scheduling=False, dcp=2, pcp=2))


def hash_block_size_of(mode: Mode) -> int:
    """The hash block size the scheduler of `mode` hashes with (the allocator's --hash-block-size must match)."""
    return mode.hash_block or BLOCK * mode.dcp


def make_vllm_config(model_dir: Path, mode: Mode, max_model_len: int = 2048) -> VllmConfig:
    """vLLM's default configuration for this model, with async scheduling as vLLM resolves it on a GPU
    (the CPU platform turns it off) and the gate as `mode` says."""
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", seed=0,
                        max_model_len=max_model_len)
    scheduler = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False,
                                scheduler_reserve_full_isl=mode.full_sequence_gate)
    cache = CacheConfig(block_size=BLOCK, mamba_cache_mode="align") if mode.mamba else CacheConfig(block_size=BLOCK)
    config = VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache)
    config.scheduler_config.async_scheduling = mode.async_scheduling
    if mode.spec_tokens:
        config.speculative_config = SpeculativeConfig(model="ngram", num_speculative_tokens=mode.spec_tokens)
    # (Set past validation, which asks for a tensor_parallel_size they divide and, for PCP, Model Runner V2: the
    # scheduler reads only these.)
    config.parallel_config.decode_context_parallel_size = mode.dcp
    config.parallel_config.prefill_context_parallel_size = mode.pcp
    config.cache_config.enable_mamba_shared_prefix_checkpoint = mode.shared_prefix_checkpoint
    register_all_kvcache_specs(config)
    return config


@dataclass(slots=True)
class Workload:
    """One random request stream: arrivals per step (some with n > 1: n requests of one prompt, as vLLM's
    front end fans them out), shared prefixes, long prompts for chunked prefill, aborts, and a pool small
    enough to preempt."""

    seed: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    watermark: float
    arrivals: dict[int, list[tuple[str, list[int], int]]] = field(default_factory=dict)  # step -> (id, prompt, max)
    aborts: dict[int, float] = field(default_factory=dict)  # step -> which unfinished request (a fraction)
    num_steps: int = 0

    @classmethod
    def random(cls, seed: int, num_steps: int = 60) -> Workload:
        rng = random.Random(seed)
        w = cls(seed, rng.choice([24, 40, 64, 200]), rng.choice([64, 128, 256, 2048]), rng.choice([4, 16, 128]),
                rng.choice([0.0, 0.0, 0.05]), num_steps=num_steps)
        prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 90))] for _ in range(3)]
        ids = 0
        for step in range(num_steps // 2):
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + \
                    [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 120))]
                n = rng.choice([1, 1, 1, 2, 3])
                for i in range(n):
                    w.arrivals.setdefault(step, []).append((f"r{ids}-{i}", prompt, rng.randrange(1, 40)))
                ids += 1
            if rng.random() < 0.08:
                w.aborts[step] = rng.random()
        return w


def sampled_token(seed: int, request_id: str, index: int) -> int:
    """The fake model's output token `index` of a request (the same for both schedulers)."""
    return random.Random(f"{seed}/{request_id}/{index}").randrange(3, VOCAB)


class Side:
    """One scheduler driven through a workload, as vLLM's engine core drives it."""

    def __init__(self, cls, config: VllmConfig, workload: Workload, mode: Mode = DEFAULT) -> None:
        spec = (SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                  sliding_window=mode.sliding_window) if mode.sliding_window
                else FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32))
        groups = [KVCacheGroupSpec(["layer"], spec)]
        if mode.replay:
            groups.append(KVCacheGroupSpec(["swa"], SlidingWindowMLASpec(
                block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=mode.replay,
                bounded_replay=True)))
        if mode.mamba:
            checkpoints = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1) \
                if mode.mamba_checkpoints else {}
            groups.append(KVCacheGroupSpec(["mamba"], MambaSpec(
                block_size=BLOCK * mode.dcp, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align",
                num_speculative_blocks=mode.spec_tokens, **checkpoints)))
        if mode.eagle_group:  # (a head size of its own, so vLLM keeps it apart from the target's group)
            groups.append(KVCacheGroupSpec(["draft"], FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.float32), is_eagle_group=True))
        if mode.extra:
            # (head sizes differ from the first group's so vLLM keeps the groups apart)
            common = dict(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
            extra = {"rswa": lambda: RSWASpec(**common, rswa_window=4),
                     "sink": lambda: SinkFullAttentionSpec(**common, sink_len=BLOCK),
                     "ring": lambda: CircularBufferSpec(**common)}[mode.extra]()
            groups.append(KVCacheGroupSpec([mode.extra], extra))
        # (Under DCP a block spans dcp times the tokens: as many fewer blocks keep the pool as tight.)
        kv_cache_config = KVCacheConfig(num_blocks=workload.num_blocks * len(groups) // mode.dcp, kv_cache_tensors=[],
                                        kv_cache_groups=groups, prefix_cache_retention_interval=mode.retention)
        self.spec_tokens = mode.spec_tokens
        block_size = BLOCK * mode.dcp  # the scheduler's: vLLM's engine scales a sharded group's block by DCP
        self.hasher = hasher(mode.hash_block or block_size)
        self.scheduler = cls(vllm_config=config, kv_cache_config=kv_cache_config, block_size=block_size,
                             log_stats=True, structured_output_manager=StructuredOutputManager(config),
                             hash_block_size=mode.hash_block or block_size)
        self.workload = workload
        self.pending: deque = deque()
        self.step_s: list[float] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
        params.update_from_generation_config({}, EOS)
        self.scheduler.add_request(Request(request_id, list(prompt), params, None, block_hasher=self.hasher))

    def abort(self, fraction: float) -> None:
        ids = sorted(self.scheduler.requests)
        if ids:
            self.scheduler.finish_requests([ids[int(fraction * len(ids))]], RequestStatus.FINISHED_ABORTED)

    def schedule(self) -> tuple:
        t = time.perf_counter()
        out = self.scheduler.schedule()
        self.step_s.append(time.perf_counter() - t)
        chunks = {r for r in out.num_scheduled_tokens if self.scheduler.requests[r].is_prefill_chunk}
        self.pending.append((out, chunks))
        return summarize(out, chunks)

    def update(self) -> tuple:
        """Feeds the oldest outstanding step its fake model output; returns the stats after it."""
        out, chunks = self.pending.popleft()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        seed = self.workload.seed
        for r in req_ids:
            req = self.scheduler.requests.get(r)
            if r in chunks or req is None:
                sampled.append([])
            elif r in out.scheduled_spec_decode_tokens:  # verified drafts: a random prefix accepted, one more
                sampled.append(features.spec_output(seed, r, req.num_output_tokens, out.scheduled_spec_decode_tokens[r],
                                                    sampled_token(seed, r, req.num_output_tokens)))
            else:
                sampled.append([sampled_token(seed, r, req.num_output_tokens)])
        loaded = features.finished_loads(out)
        output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[],
                                   kv_connector_output=KVConnectorOutput(finished_recving=loaded) if loaded else None)
        self.scheduler.update_from_output(out, output)
        if self.spec_tokens:  # the drafter's next proposals (the engine's update_draft_token_ids)
            running = [r.request_id for r in self.scheduler.running if not r.is_prefill_chunk]
            self.scheduler.update_draft_token_ids(DraftTokenIds(running, [
                features.drafts(seed, r, self.scheduler.requests[r].num_output_tokens, self.spec_tokens)
                for r in running]))
        stats = self.scheduler.make_stats()
        p = stats.prefix_cache_stats if stats is not None else None
        return (p.requests, p.queries, p.hits, p.preempted_requests) if p is not None else None


def summarize(out, chunks) -> tuple:
    """What must match in a SchedulerOutput (block ids included)."""
    cached = out.scheduled_cached_reqs
    return (dict(out.num_scheduled_tokens),
            sorted((n.req_id, tuple(map(tuple, n.block_ids)), n.num_computed_tokens) for n in out.scheduled_new_reqs),
            sorted(zip(cached.req_ids, [None if b is None else tuple(map(tuple, b)) for b in cached.new_block_ids],
                       cached.num_computed_tokens)),
            sorted(cached.resumed_req_ids), sorted(out.preempted_req_ids or ()), sorted(out.finished_req_ids),
            sorted(chunks))


@dataclass(slots=True)
class Outcome:
    steps: int = 0
    preemptions: int = 0
    hits: int = 0
    chunked: int = 0
    n_gt_1: int = 0
    rpcs: int = 0
    copies: int = 0  # partial prefix hits' copies (sub-block hits)
    stock_s: list[float] = field(default_factory=list)
    remote_s: list[float] = field(default_factory=list)

    COUNTS = ("steps", "preemptions", "hits", "chunked", "n_gt_1", "rpcs", "copies")

    def add(self, other: Outcome) -> Outcome:
        """Adds `other`'s counts to these (the timings stay each run's own); returns self."""
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def check_pool(scheduler, where: str) -> None:
    """The pool equals the scheduler's replica once its Steps are in: the free and the cached blocks, and
    each live request's block table (its token count may lag by up to a block: calls that changed no block
    are not sent)."""
    m = scheduler.kv_cache_manager
    m.flush()  # what update_from_output recorded since the last schedule()
    m.wait()
    client, pool_id = scheduler.kvservice_client, m.pool_id
    stats = client.get_stats(check_invariants=True, pool_ids=[pool_id]).pools[pool_id]
    assert not stats.invariant_violation, f"{where}: {stats.invariant_violation}"
    # PoolStats.num_cached_blocks counts cached hashes, as len() of vLLM's map does
    replica = (m.block_pool.get_num_free_blocks(), len(m.block_pool.cached_block_hash_to_block))
    assert (stats.num_free_blocks, stats.num_cached_blocks) == replica, (where, stats)
    for request_id in m.coordinator.single_type_managers[0].req_to_blocks:
        info = client.get_request(pool_id, request_id)
        assert info.block_ids == m.get_block_ids(request_id), f"{where}: request {request_id!r}"
        lag = scheduler.requests[request_id].num_tokens - info.num_tokens
        assert 0 <= lag <= scheduler.block_size, f"{where}: request {request_id!r} lags {lag} tokens"


def run_seeds(mode: Mode, config: VllmConfig, address: str, pool_prefix: str, num_seeds: int,
              settings: dict | None = None) -> Outcome:
    """`run_pair` on random workloads of 100 steps, seeds 0 .. num_seeds - 1 (pools `{pool_prefix}-{seed}`):
    their counts summed."""
    totals = Outcome()
    for seed in range(num_seeds):
        totals.add(run_pair(Workload.random(seed, num_steps=100), mode, config, address, f"{pool_prefix}-{seed}",
                            settings))
    return totals


def run_pair(workload: Workload, mode: Mode, config: VllmConfig, address: str, pool_id: str,
             settings: dict | None = None) -> Outcome:
    """Runs the stock and the kvservice-backed scheduler (`settings`: more of its kvservice settings) through
    `workload`; raises AssertionError naming the step and the difference at the first divergence."""
    sc = config.scheduler_config
    sc.max_num_batched_tokens, sc.max_num_seqs, sc.watermark = (workload.max_num_batched_tokens,
                                                                workload.max_num_seqs, workload.watermark)
    config.additional_config = {"kvservice": {"address": address, "pool_id": pool_id, **(settings or {})}}
    config.cache_config.num_gpu_blocks = workload.num_blocks
    config.kv_transfer_config = (features.connector_config(workload.seed, mode.connector == "async")
                                 if mode.connector else None)
    stock_cls, remote_cls = ((StockAsyncScheduler, AsyncScheduler) if mode.async_scheduling
                             else (StockScheduler, Scheduler))
    stock, remote = Side(stock_cls, config, workload, mode), Side(remote_cls, config, workload, mode)
    outcome = Outcome(n_gt_1=sum(1 for a in workload.arrivals.values() for r, _, _ in a if r.endswith("-1")))
    depth = 2 if mode.async_scheduling else 1  # outstanding steps (vLLM's engine core batch queue)
    try:
        for step in range(workload.num_steps):
            for args in workload.arrivals.get(step, ()):
                stock.add(*args)
                remote.add(*args)
            if step in workload.aborts:
                stock.abort(workload.aborts[step])
                remote.abort(workload.aborts[step])
            a, b = stock.schedule(), remote.schedule()
            assert a == b, f"{mode.name}, seed {workload.seed}, step {step}: stock {a} != kvservice {b}"
            if step % 10 == 9:
                check_pool(remote.scheduler, f"{mode.name}, seed {workload.seed}, step {step}")
            outcome.steps += 1
            outcome.preemptions += len(a[4])
            outcome.hits += sum(1 for _, _, computed in a[1] if computed)
            outcome.chunked += len(a[6])
            while len(stock.pending) >= depth or (stock.pending and not a[0]):
                sa, sb = stock.update(), remote.update()
                assert sa == sb, f"{mode.name}, seed {workload.seed}, step {step}: prefix stats {sa} != {sb}"
            if not stock.scheduler.requests and step >= max(workload.arrivals, default=0):
                break
        manager = remote.scheduler.kv_cache_manager
        outcome.rpcs = manager.num_rpcs - manager.num_idle_rpcs  # one more each time the engine goes idle
        outcome.copies = manager.num_block_copies
        check_pool(remote.scheduler, f"{mode.name}, seed {workload.seed}, the end")
        outcome.stock_s, outcome.remote_s = stock.step_s, remote.step_s
    finally:
        remote.scheduler.shutdown()
        stock.scheduler.shutdown()
    return outcome
