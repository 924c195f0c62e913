"""The engine end to end: a real allocator process, real paged kernels, outputs equal to the dense model."""

import random

import pytest
import torch

from worker.actor import LocalWorkers, PoolLayout
from worker.engine import Engine, EngineConfig
from worker.model import ModelConfig, TinyTransformer
from worker.sampling import SamplingParams
from worker.verify import verify

MODEL = ModelConfig()


@pytest.fixture(scope="module")
def model():
    return TinyTransformer(MODEL)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def engine(server, pool_id, *, num_blocks=128, dcp=1, budget=256, backend="torch", max_num_seqs=16,
           caching=True):
    cfg = EngineConfig(pool_id=pool_id, num_blocks=num_blocks, block_size=16, dcp_world_size=dcp, max_model_len=512,
                       max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_prefix_caching=caching)
    layout = PoolLayout(MODEL, num_blocks, 16, cfg.max_num_rows, cfg.max_num_blocks_per_req, budget, dcp,
                        backend=backend)
    return Engine(server.client(client_name=pool_id), LocalWorkers(layout), cfg, record_logits=True)


def prompts(n, length, seed=0, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(MODEL.vocab_size) for _ in range(shared)]
    return [prefix + [rng.randrange(MODEL.vocab_size) for _ in range(length - shared)] for _ in range(n)]


def check(model, eng):
    result = verify(model, eng.finished)
    assert result.ok, result.mismatches[:3]
    assert result.max_logit_error < 1e-3
    stats = eng.client.get_stats(check_invariants=True).pools[eng.config.pool_id]
    assert stats.invariant_violation == "" and stats.num_requests == 0
    assert stats.num_free_blocks == eng.config.num_blocks - 1  # every block back
    return result


def test_plain_greedy_decoding(server, model):
    eng = engine(server, "plain")
    for p in prompts(3, 40):
        eng.add_request(p, SamplingParams(max_tokens=8))
    eng.run()
    assert len(eng.finished) == 3 and all(len(s.output) == 8 for s in eng.finished)
    check(model, eng)


def test_prefix_hit_computes_only_the_suffix(server, model):
    eng = engine(server, "prefix")
    prompt = prompts(1, 70)[0]
    first = eng.add_request(prompt, SamplingParams(max_tokens=4))
    eng.run()
    computed_before = eng.stats.computed_tokens
    second = eng.add_request(prompt + [5, 6, 7], SamplingParams(max_tokens=4))
    eng.run()
    assert first.hit_tokens == 0
    assert second.hit_tokens == 64  # 4 full 16-token blocks of the shared prompt were cached
    # It computed its 9 uncached prompt tokens and 3 decode tokens, nothing of the hit.
    assert eng.stats.computed_tokens - computed_before == (73 - 64) + 3
    check(model, eng)


def test_chunked_prefill_longer_than_the_budget(server, model):
    eng = engine(server, "chunked", budget=48)
    long = eng.add_request(prompts(1, 150, seed=3)[0], SamplingParams(max_tokens=5))
    short = eng.add_request(prompts(1, 20, seed=4)[0], SamplingParams(max_tokens=5))
    eng.run()
    assert eng.stats.steps >= 150 // 48 + 4
    assert long.finished and short.finished
    check(model, eng)


def test_dcp2_equals_dcp1(server, model):
    outputs = {}
    for dcp in (1, 2):
        eng = engine(server, f"dcp{dcp}", dcp=dcp)
        for p in prompts(4, 37, seed=7, shared=16):
            eng.add_request(p, SamplingParams(max_tokens=6))
        eng.run()
        check(model, eng)
        outputs[dcp] = sorted((s.request_id, tuple(s.output)) for s in eng.finished)
    assert outputs[1] == outputs[2]


def test_preemption_and_recompute_under_a_tiny_pool(server, model):
    eng = engine(server, "tiny", num_blocks=12, budget=128)  # 11 blocks x 16 tokens for 4 requests
    for p in prompts(4, 30, seed=9):
        eng.add_request(p, SamplingParams(max_tokens=20))
    eng.run(max_steps=500)
    assert len(eng.finished) == 4
    assert eng.stats.preemptions > 0
    check(model, eng)


def test_parallel_sampling_forks_with_copy_on_write(server, model):
    eng = engine(server, "fork")
    parent = eng.add_request(prompts(1, 21, seed=11)[0], SamplingParams(max_tokens=6, n=4, temperature=0.8, seed=5))
    eng.run()
    family = [s for s in eng.finished if s is parent or s.parent is parent]
    assert len(family) == 4 and eng.stats.forks == 3
    assert eng.stats.copies >= 3  # the shared partial prompt block was copied for the writers
    assert len({tuple(s.output) for s in family}) > 1  # different seeds diverge
    check(model, eng)


def test_through_the_triton_interpreter(server, model):
    eng = engine(server, "triton", backend="triton", num_blocks=16)
    eng.add_request(prompts(1, 20, seed=13)[0], SamplingParams(max_tokens=2))
    eng.run()
    assert eng.workers.backend == "triton"
    check(model, eng)


def test_prefix_transfer_between_pools_computes_only_the_suffix(server, model):
    layout = "transfer-test-layout"
    engines = {}
    for pid in ("xfer-A", "xfer-B"):
        cfg = EngineConfig(pool_id=pid, num_blocks=64, block_size=16, max_model_len=512, max_num_batched_tokens=256,
                           allow_transfers=True, kv_layout=layout)
        lay = PoolLayout(MODEL, 64, 16, cfg.max_num_rows, cfg.max_num_blocks_per_req, 256)
        engines[pid] = Engine(server.client(client_name=pid), LocalWorkers(lay), cfg, record_logits=True)
    a, b = engines["xfer-A"], engines["xfer-B"]
    a.peers["xfer-B"], b.peers["xfer-A"] = b.workers, a.workers
    prompt = prompts(1, 150, seed=31)[0]
    a.add_request(prompt, SamplingParams(max_tokens=3))
    a.run()
    seq = b.add_request(prompt + [9, 9], SamplingParams(max_tokens=4))
    b.run()
    assert b.stats.transfers == 1 and seq.transferred_tokens == 144  # 9 blocks copied from A
    assert seq.hit_tokens == 144 and b.stats.computed_tokens == (152 - 144) + 3  # B computed only the suffix
    check(model, b)
    check(model, a)
