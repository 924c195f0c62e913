"""`worker.LLM(dcp=2)` on models with sliding-window layers (vLLM's per-group `dcp_sharded`): full-attention
groups are sharded across the two ranks, sliding-window groups are kept whole on each. Greedy outputs
token for token equal to `transformers.generate`, with sequences that slide the window across many blocks."""

from __future__ import annotations

import pytest
import torch

from kvservice.core import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from kvservice.errors import InvalidArgument
from tests.hf_helpers import SLIDING_WINDOW, Reference, save_model
from tests.test_engine import one_thread  # noqa: F401  - autouse: one torch thread in this module
from tests.test_llm import assert_drained, assert_matches, shared_prefix_prompts
from worker import LLM, SamplingParams

BLOCK = 16  # per rank (the service hashes by 16): a full-attention block spans 32 tokens, a window block 16
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: save_model(arch, tmp_path_factory.mktemp(arch)) for arch in ("mistral", "gemma3")}


def test_mistral_dcp2_keeps_the_window_on_every_rank(checkpoints, server):
    """Every layer is windowed: the pool's only group is replicated, so both ranks write every token and
    attend over the whole window themselves (nothing to merge). The prompts (51-88 tokens + 24 generated)
    slide the 24-token window over 5-7 blocks of 16; the blocks it leaves are freed and reused: the pool is
    smaller than what the three sequences would hold without the window, and nothing is preempted."""
    prompts = shared_prefix_prompts(3, seed=50, shared=48, long=20)
    shared_blocks = 48 // BLOCK
    unwindowed = sum(-(-(len(p) + MAX_TOKENS - 1) // BLOCK) for p in prompts) - 2 * shared_blocks
    num_blocks = 10
    assert unwindowed > num_blocks - 1
    with LLM(checkpoints["mistral"], allocator=server.target, dcp=2, block_size=BLOCK, num_blocks=num_blocks,
             max_model_len=256, max_num_seqs=3, max_num_batched_tokens=32, backend="torch",
             distributed_executor_backend="uni") as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        assert [g.dcp_sharded for g in llm.config.groups] == [False]
        assert llm.config.tokens_per_block(0) == BLOCK  # the window's blocks are not scaled by the 2 ranks
        assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
        assert llm.stats.hit_tokens > 0  # the shared prefix hit, window included
        assert llm.stats.preemptions == 0
        # Each rank stored every token (a sharded group would leave each rank half of them).
        rank0, rank1 = llm.engine.workers.runners
        for k0, k1 in zip(rank0.key_caches + rank0.value_caches, rank1.key_caches + rank1.value_caches):
            assert k0.abs().sum() > 0 and torch.equal(k0, k1)
        assert_drained(server, llm)
    assert_matches(Reference(checkpoints["mistral"]), prompts, outputs, MAX_TOKENS)


@pytest.mark.slow  # make test-slow (make test stays under 15 minutes)
def test_gemma3_dcp2_ray_ranks_shard_global_layers_only(checkpoints, server):
    """Alternating layers: the global layers' group is sharded over two Ray ranks (partial attention merged
    by LSE over gloo), the sliding layers' group is whole on each rank. Shared-prefix prompts hit on the
    groups' common boundary (32 tokens); chunked prefill; n=2 forks copy-on-write in both groups."""
    prompts = shared_prefix_prompts(3, seed=60, shared=40, long=30)
    params = [SamplingParams(max_tokens=MAX_TOKENS, n=1 + i % 2, ignore_eos=True) for i in range(len(prompts))]
    with LLM(checkpoints["gemma3"], allocator=server.target, dcp=2, block_size=BLOCK, num_blocks=48,
             max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, backend="torch") as llm:
        outputs = llm.generate(prompts, params)
        assert type(llm.engine.workers).__name__ == "RayWorkers" and len(llm.engine.workers.actors) == 2
        full, window = llm.config.groups
        assert full.dcp_sharded and not window.dcp_sharded and window.sliding_window == SLIDING_WINDOW
        assert (llm.config.tokens_per_block(0), llm.config.tokens_per_block(1)) == (2 * BLOCK, BLOCK)
        assert llm.stats.hit_tokens > 0 and llm.stats.hit_tokens % (2 * BLOCK) == 0
        assert llm.stats.forks == 1
        assert_drained(server, llm)
    assert_matches(Reference(checkpoints["gemma3"]), prompts, outputs, MAX_TOKENS)


def test_register_pool_under_dcp_names_what_it_cannot_shard(server):
    """A window a client marks DCP-sharded is refused before it is sent (the allocator would keep it
    whole on each rank); chunked local attention marked sharded under DCP is refused by the allocator, nothing
    registered (vLLM shards only full attention), and accepted replicated."""
    client = server.client()
    sharded_window = KVCacheConfig(16, [FullAttentionSpec(16), SlidingWindowSpec(16, 24)])
    with pytest.raises(ValueError, match=r"groups\[1\]: a sliding window under dcp_world_size 2 is replicated"):
        client.register_pool("dcp-sharded-window", sharded_window, 256, dcp_world_size=2)
    with pytest.raises(InvalidArgument, match=r"config.groups\[0\].replicated = False: .*dcp_world_size 2.* "
                                              r"a chunked_local group must be replicated"):
        client.register_pool("dcp-chunked", KVCacheConfig(16, [ChunkedLocalAttentionSpec(16, 32)]), 256,
                             dcp_world_size=2)
    replicated = KVCacheConfig(16, [FullAttentionSpec(16), SlidingWindowSpec(16, 24, dcp_sharded=False)])
    client.register_pool("dcp-window", replicated, 256, dcp_world_size=2)
    chunked = KVCacheConfig(16, [ChunkedLocalAttentionSpec(16, 32, dcp_sharded=False)])
    client.register_pool("dcp-chunked-replicated", chunked, 256, dcp_world_size=2)
    pools = client.get_stats().pools
    assert "dcp-window" in pools and "dcp-chunked-replicated" in pools
    assert "dcp-sharded-window" not in pools and "dcp-chunked" not in pools
