"""Sliding window, chunked local, mamba, hybrid groups, mixed block sizes and DCP."""

import pytest

from kvservice.core import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    MambaSpec,
    Request,
    SlidingWindowSpec,
)
from kvservice.core.invariants import check_invariants
from tests.core_helpers import admit, free_ids, ref_cnts, tokens


def manager(num_blocks, *specs, **kw):
    return KVCacheManager(KVCacheConfig(num_blocks, list(specs)), 4096, **kw)


def decode(m, r, token=7):
    r.append_output_token_ids(token)
    new = m.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    return new


def test_sliding_window_recycles_skipped_blocks_and_hits():
    m = manager(20, SlidingWindowSpec(4, sliding_window=8))
    a = Request("a", tokens(0, 20), 4)
    assert admit(m, a)[0].get_block_ids() == ([1, 2, 3, 4, 5],)
    # At 20 computed tokens the next token sees (20-8, 20]: the first 13 positions are skipped,
    # so blocks 0..2 are freed (tail first, cached -> queue tail) and replaced by the null block.
    assert decode(m, a).get_block_ids() == ([6],)
    assert m.get_block_ids("a") == ([0, 0, 0, 4, 5, 6],)
    assert free_ids(m)[-3:] == [3, 2, 1]
    check_invariants(m)
    # Same prefix + 4: right-to-left, the first run of cdiv(8-1, 4) = 2 cached blocks ends the hit.
    b = Request("b", tokens(0, 20) + [7, 9, 9, 9], 4)
    hits, n = m.get_computed_blocks(b)
    assert n == 20 and hits.get_block_ids() == ([0, 0, 0, 4, 5],)
    new = m.allocate_slots(b, 4, n, hits)
    assert new.get_block_ids() == ([7],) and m.get_block_ids("b") == ([0, 0, 0, 4, 5, 7],)
    assert ref_cnts(m)[4] == 2
    m.free(a)
    m.free(b)
    assert m.block_pool.get_num_free_blocks() == 19
    check_invariants(m)


def test_sliding_window_without_a_full_run_hits_only_the_leading_run():
    m = manager(20, SlidingWindowSpec(4, sliding_window=16))  # needs cdiv(15, 4) = 4 contiguous
    a = Request("a", tokens(0, 12), 4)
    admit(m, a)
    m.free(a)
    # Blocks 0..2 cached: no run of 4, so the hit is the leading run (3 blocks) from block 0.
    b = Request("b", tokens(0, 24), 4)
    hits, n = m.get_computed_blocks(b)
    assert n == 12 and hits.get_block_ids() == ([1, 2, 3],)


def test_chunked_local_hit_counts_past_chunks_as_null_hits():
    m = manager(20, ChunkedLocalAttentionSpec(4, attention_chunk_size=8))
    a = Request("a", tokens(0, 20), 4)
    # No later token attends to a past chunk: positions [0, 16) are a (null) hit even uncached.
    new, n = admit(m, a)
    assert n == 16 and new.get_block_ids() == ([1],)
    assert m.get_block_ids("a") == ([0, 0, 0, 0, 1],)
    assert decode(m, a).get_block_ids() == ([2],)
    b = Request("b", tokens(0, 20) + [1, 2, 3, 4], 4)
    hits, n = m.get_computed_blocks(b)  # max 23 -> chunk starts at 16 -> blocks 0..3 null, 4 cached
    assert n == 20 and hits.get_block_ids() == ([0, 0, 0, 0, 1],)
    assert m.allocate_slots(b, 4, n, hits).get_block_ids() == ([3],)
    assert m.get_block_ids("b") == ([0, 0, 0, 0, 1, 3],)
    check_invariants(m)
    # Within one chunk (8 computed) the chunk [0, 8) is skipped once 8 tokens are computed.
    c = Request("c", tokens(500, 8), 4)
    admit(m, c)
    assert m.get_block_ids("c") == ([4, 5],)
    decode(m, c)
    assert m.get_block_ids("c") == ([0, 0, 6],)
    check_invariants(m)


def test_mamba_keeps_only_the_last_state_block():
    """vLLM 0.33.0's "align" mode, block for block (checked on vLLM itself): a chunk gets only the
    block it ends in, earlier positions are null padding."""
    m = manager(20, MambaSpec(4))
    a = Request("a", tokens(0, 12), 4)
    assert admit(m, a)[0].get_block_ids() == ([0, 0, 1],)
    b = Request("b", tokens(0, 13), 4)
    hits, n = m.get_computed_blocks(b)
    assert n == 12 and hits.get_block_ids() == ([0, 0, 1],)
    # That state is written by this step's forward: the hit waits for the next step.
    assert m.allocate_slots(b, 1, n, hits) is None
    m.new_step_starts()
    assert m.allocate_slots(b, 1, n, hits).get_block_ids() == ([2],)
    assert m.get_block_ids("b") == ([0, 0, 1, 2],)
    m.new_step_starts()
    decode(m, a)  # a reads its state in block 1 and writes the next one
    assert m.get_block_ids("a") == ([0, 0, 1, 3],)
    check_invariants(m)


def test_hybrid_full_and_sliding_window():
    m = manager(30, FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=8))
    a = Request("a", tokens(0, 20), 4)
    assert admit(m, a)[0].get_block_ids() == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    decode(m, a)
    assert m.get_block_ids("a") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    b = Request("b", tokens(0, 20) + [7, 1, 1, 1], 4)
    hits, n = m.get_computed_blocks(b)
    assert n == 20 and hits.get_block_ids() == ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10])
    check_invariants(m)


def test_hybrid_sliding_window_miss_shrinks_full_attention_hit():
    m = manager(40, FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=16))
    a = Request("a", tokens(0, 20), 4)
    admit(m, a)
    decode(m, a)  # 20 computed: SW frees its block 0 (cached, in the queue)
    assert m.get_block_ids("a")[1][0] == 0
    filler = Request("filler", tokens(1000, 4 * 14), 4)
    admit(m, filler)  # takes every never-used block and then evicts SW block 0's hash
    b = Request("b", tokens(0, 16) + [5, 5, 5, 5], 4)
    assert m.get_computed_blocks(b)[1] == 0  # full attention had 16; the window has no run of 4
    check_invariants(m)


def test_mixed_block_sizes_full_16_mamba_64_style():
    """vLLM 0.33.0 (checked on vLLM itself): the 20-token chunk stores only the state it ends in
    (block 2, at 24), so a request sharing 16 tokens finds no Mamba state to resume from."""
    m = manager(40, FullAttentionSpec(4), MambaSpec(8))
    assert m.hash_block_size == 4 and m.scheduler_block_size == 8
    a = Request("a", tokens(0, 20), 4)
    assert admit(m, a)[0].get_block_ids() == ([1, 2, 3, 4, 5], [0, 0, 6])
    m.new_step_starts()
    b = Request("b", tokens(0, 24), 4)
    hits, n = m.get_computed_blocks(b)
    assert n == 0
    assert m.allocate_slots(b, 8, n, hits).get_block_ids() == ([7, 8], [9])
    check_invariants(m)


def test_coarse_group_caches_under_last_fine_hash():
    m = manager(40, FullAttentionSpec(4), FullAttentionSpec(8))
    a = Request("a", tokens(0, 16), 4)
    admit(m, a)
    coarse = [b.block_hash[:-4] for b in m.get_blocks("a").blocks[1]]
    assert coarse == [a.block_hashes[1], a.block_hashes[3]]


def test_dcp_scales_block_size():
    m = manager(20, FullAttentionSpec(4), dcp_world_size=2)
    assert m.hash_block_size == 8
    a = Request("a", tokens(0, 20), 8)
    assert admit(m, a)[0].get_block_ids() == ([1, 2, 3],)
    b = Request("b", tokens(0, 20), 8)
    assert admit(m, b)[1] == 16
    with pytest.raises(ValueError, match="SlidingWindowSpec does not support decode context parallelism"):
        manager(20, SlidingWindowSpec(4, 8), dcp_world_size=2)


def test_dcp_shards_full_attention_and_replicates_the_window():
    """vLLM 0.33.0's per-group `dcp_sharded` (run on vLLM itself: the same ids): under DCP 2 a full-attention
    block spans 8 tokens, a replicated window's block 4; hashed every 4 tokens, hits on the 8-token LCM."""
    m = manager(30, FullAttentionSpec(4), SlidingWindowSpec(4, 8, dcp_sharded=False), dcp_world_size=2)
    assert (m.hash_block_size, m.scheduler_block_size, m.coordinator.group_block_sizes) == (4, 8, (8, 4))
    a = Request("a", tokens(0, 20), 4)
    new, _ = admit(m, a)
    assert new.get_block_ids() == ([1, 2, 3], [4, 5, 6, 7, 8])
    assert decode(m, a).get_block_ids() == ([], [9])  # 21 tokens: the window's 6th block
    assert m.get_block_ids("a") == ([1, 2, 3], [0, 0, 0, 7, 8, 9])  # blocks before position 13 freed
    for _ in range(3):
        decode(m, a)
    assert m.get_block_ids("a") == ([1, 2, 3], [0, 0, 0, 0, 8, 9])
    assert decode(m, a).get_block_ids() == ([10], [11])  # 25 tokens: a new block in each group
    assert free_ids(m)[:3] == [12, 13, 14]
    b = Request("b", tokens(0, 20), 4)
    hits, n = m.get_computed_blocks(b)
    assert n == 16 and hits.get_block_ids() == ([1, 2], [0, 0, 6, 7])  # the window's freed blocks, still cached
    assert m.allocate_slots(b, 4, n, hits).get_block_ids() == ([12], [13])
    c = Request("c", tokens(0, 14), 4)
    assert m.get_computed_blocks(c)[0].get_block_ids() == ([1], [4, 5])  # 8 tokens: the LCM boundary
    check_invariants(m)
    m.free(a)
    m.free(b)
    assert free_ids(m)[:5] == [13, 12, 11, 10, 14]
    check_invariants(m)


def test_dcp_window_only_pool_is_not_scaled():
    """Every layer windowed (Mistral): the one group is replicated, so DCP leaves its blocks at 4 tokens."""
    m = manager(12, SlidingWindowSpec(4, 8, dcp_sharded=False), dcp_world_size=2)
    assert (m.hash_block_size, m.scheduler_block_size) == (4, 4)
    a = Request("a", tokens(0, 14), 4)
    assert admit(m, a)[0].get_block_ids() == ([1, 2, 3, 4],)
    for _ in range(4):
        decode(m, a)
    assert m.get_block_ids("a") == ([0, 0, 3, 4, 5],)
    assert free_ids(m) == [6, 7, 8, 9, 10, 11, 1, 2]
    hits, n = m.get_computed_blocks(Request("b", tokens(0, 14), 4))
    assert n == 12 and hits.get_block_ids() == ([0, 2, 3],)
    check_invariants(m)


def test_hash_block_size_must_divide_every_group():
    with pytest.raises(ValueError, match="must be a multiple of hash_block_size 16"):
        KVCacheManager(KVCacheConfig(10, [FullAttentionSpec(8)]), 100, hash_block_size=16)
    m = KVCacheManager(KVCacheConfig(10, [FullAttentionSpec(32)]), 1000, hash_block_size=16)
    r = Request("r", tokens(0, 70), 16)
    assert admit(m, r)[0].get_block_ids() == ([1, 2, 3],)
    assert admit(m, Request("s", tokens(0, 70), 16))[1] == 64
