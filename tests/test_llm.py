"""`worker.LLM` on random-init Hugging Face checkpoints: greedy outputs token for token equal to
`transformers.generate` on the same directory, through every path the engine has."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from tests.hf_helpers import ARCHITECTURES, VOCAB, Reference, save_model
from tests.test_engine import one_thread  # noqa: F401  - autouse: one torch thread in this module
from worker import LLM, SamplingParams

ARCHS = list(ARCHITECTURES)
# Pools that preempt the workload of `test_every_engine_path_matches_transformers` (Gemma 3 holds blocks in
# two groups; Mistral's window recycles them).
SMALL_POOL = {"llama": 10, "qwen2": 10, "qwen3": 10, "mistral": 7, "gemma3": 13}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: save_model(arch, tmp_path_factory.mktemp(arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {arch: Reference(path) for arch, path in checkpoints.items()}


def shared_prefix_prompts(n: int, seed: int = 0, shared: int = 40, long: int = 0) -> list[list[int]]:
    """`n` prompts sharing a `shared`-token system prompt (the last one `long` tokens longer)."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(shared)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(n)]
    prompts[-1] += [rng.randrange(VOCAB) for _ in range(long)]
    return prompts


def assert_matches(reference: Reference, prompts, outputs, max_tokens: int) -> None:
    expected = [reference.generate(p, max_tokens) for p in prompts]
    for i, (out, exp) in enumerate(zip(outputs, expected)):
        for c in out.outputs:
            assert c.token_ids == exp, f"prompt {i}, sample {c.index}: {c.token_ids} != transformers' {exp}"
    assert len({tuple(e) for e in expected}) == len(prompts), "the model ignores its context: a weak check"


def assert_drained(server, llm: LLM) -> None:
    stats = server.client().get_stats(check_invariants=True).pools[llm.config.pool_id]
    assert stats.invariant_violation == "" and stats.num_requests == 0
    assert stats.num_free_blocks == llm.config.num_blocks - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_every_engine_path_matches_transformers(arch, checkpoints, references, server):
    """Shared-prefix prompts (prefix hits), one longer than the token budget (chunked prefill), n=2 on half
    of them (fork + copy-on-write), in a pool small enough to preempt."""
    prompts = shared_prefix_prompts(5, seed=ARCHS.index(arch), long=40)
    params = [SamplingParams(max_tokens=16, n=1 + i % 2) for i in range(len(prompts))]
    with LLM(checkpoints[arch], allocator=server.target, num_blocks=SMALL_POOL[arch], max_model_len=256, max_num_seqs=4,
             max_num_batched_tokens=32, backend="torch") as llm:
        outputs = llm.generate(prompts, params)
        s = llm.stats
        assert s.preemptions > 0 and s.hit_tokens > 0 and s.forks == 2 and s.copies > 0
        assert [len(o.outputs) for o in outputs] == [1, 2, 1, 2, 1]
        assert_drained(server, llm)
    assert_matches(references[arch], prompts, outputs, 16)


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_interpreter_matches_transformers(arch, checkpoints, references, server):
    prompts = shared_prefix_prompts(2, seed=10 + ARCHS.index(arch))
    with LLM(checkpoints[arch], allocator=server.target, num_blocks=32, max_model_len=256, max_num_seqs=4,
             max_num_batched_tokens=64, backend="triton") as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=6))
        assert llm.engine.workers.backend == "triton"
    assert_matches(references[arch], prompts, outputs, 6)


def test_sliding_window_recycles_blocks_on_mistral(checkpoints, references, server):
    """120 tokens need 8 blocks under full attention; a 24-token window plus a 32-token chunk touch at most
    5, so a pool of 5 blocks generates them without preempting (the allocator frees what the window left
    behind and hands it out again)."""
    prompt = shared_prefix_prompts(1, seed=20, shared=80)[0][:80]
    with LLM(checkpoints["mistral"], allocator=server.target, num_blocks=6, max_model_len=256, max_num_seqs=1,
             max_num_batched_tokens=32) as llm:
        [out] = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))
        assert llm.stats.preemptions == 0 and llm.stats.peak_blocks <= 5
        assert_drained(server, llm)
    assert out.outputs[0].token_ids == references["mistral"].generate(prompt, 40)[:len(out.outputs[0].token_ids)]
    assert len(out.outputs[0].token_ids) == 40


def test_prefix_hit_computes_only_the_suffix(checkpoints, references, server):
    prompt = shared_prefix_prompts(1, seed=30, shared=70)[0][:70]
    with LLM(checkpoints["qwen2"], allocator=server.target, num_blocks=64, max_model_len=256) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=4))
        before = llm.stats.computed_tokens
        [out] = llm.generate([prompt + [5, 6, 7]], SamplingParams(max_tokens=4))
        assert out.num_cached_tokens == 64  # 4 full blocks of the first prompt
        assert llm.stats.computed_tokens - before == (73 - 64) + 3
    assert out.outputs[0].token_ids == references["qwen2"].generate(prompt + [5, 6, 7], 4)


def test_dcp2_ray_ranks_match_transformers(checkpoints, references, server):
    prompts = shared_prefix_prompts(3, seed=40)
    with LLM(checkpoints["llama"], allocator=server.target, dcp=2, num_blocks=32, max_model_len=256,
             max_num_seqs=4, max_num_batched_tokens=64, backend="torch") as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=10, n=2))
        assert type(llm.engine.workers).__name__ == "RayWorkers" and len(llm.engine.workers.actors) == 2
        assert llm.stats.hit_tokens > 0
    assert_matches(references["llama"], prompts, outputs, 10)


def test_stop_tokens_and_eos_as_generate(checkpoints, references, tmp_path):
    """EOS from generation_config.json stops both; ignore_eos runs on; stop_token_ids stop ours. Also the
    default allocator (a `kvservice serve` child with its embedded Redis), started and stopped by LLM."""
    prompt = shared_prefix_prompts(1, seed=50)[0]
    free_run = references["llama"].generate(prompt, 8)
    eos_dir = tmp_path / "eos"
    shutil.copytree(checkpoints["llama"], eos_dir)
    gen = json.loads((eos_dir / "generation_config.json").read_text())
    (eos_dir / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": free_run[2]}))
    expected = Reference(eos_dir).generate(prompt, 8)
    assert expected == free_run[:free_run.index(free_run[2]) + 1]
    with LLM(eos_dir, max_model_len=256, num_blocks=32) as llm:
        assert llm._serve is not None
        [eos, ignored, stopped] = llm.generate([prompt] * 3, [
            SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, ignore_eos=True),
            SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[free_run[4]])])
        serve = llm._serve
    assert serve.proc.poll() is not None  # close() stopped the allocator it started
    assert eos.outputs[0].token_ids == expected and eos.outputs[0].finish_reason == "stop"
    assert ignored.outputs[0].token_ids == free_run and ignored.outputs[0].finish_reason == "length"
    assert stopped.outputs[0].token_ids == free_run[:free_run.index(free_run[4]) + 1]
    assert stopped.outputs[0].stop_reason == free_run[4]
