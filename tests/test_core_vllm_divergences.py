"""Issue 14's three divergences from vLLM 0.33.0, each reproduced with the issue's exact block ids
(the numbers vLLM itself gives; before the fix kvservice gave the others quoted)."""

from kvservice.core import FullAttentionSpec, KVCacheConfig, KVCacheManager, MambaSpec, Request, SlidingWindowSpec
from kvservice.core.invariants import check_invariants
from kvservice.hashing import HashSpec
from tests.core_helpers import admit, free_ids


def test_sliding_window_block_smaller_than_the_lcm_caches_only_reachable_blocks():
    """Full attention 32 + SWA block 8, window 8: only the SWA blocks an LCM-aligned hit can use are
    cached; the rest are unhashed scratch, freed to the queue's head and reused first, so the cached
    full-attention blocks survive (before: ([11, 12], [13, 14, 15, 2, 1]))."""
    m = KVCacheManager(KVCacheConfig(16, [FullAttentionSpec(32), SlidingWindowSpec(8, 8)]), 1024)
    assert (m.hash_block_size, m.scheduler_block_size) == (8, 32)
    a = Request("a", list(range(64)), 8)
    assert admit(m, a)[0].get_block_ids() == ([1, 2], [3, 4, 5, 6, 7, 8, 9, 10])
    cached_sw = [b.block_id for b in m.get_blocks("a").blocks[1] if b.block_hash is not None]
    assert cached_sw == [6, 10]  # the last block before each 32-token boundary
    m.free(a)
    assert free_ids(m) == [9, 8, 7, 5, 4, 3, 11, 12, 13, 14, 15, 2, 1, 10, 6]
    b = Request("b", list(range(1000, 1040)), 8)
    new, hit = admit(m, b)
    assert hit == 0 and new.get_block_ids() == ([9, 8], [7, 5, 4, 3, 11])
    check_invariants(m)


def test_mamba_chunk_longer_than_a_block_gets_only_the_block_it_ends_in():
    """Full 16 + Mamba 16, a 55-token prefill: vLLM pads with the null block and allocates only the
    block the chunk ends in, so a request sharing 48 tokens finds no state (before:
    ([1, 2, 3, 4], [5, 6, 7, 8]) and a 48-token hit)."""
    m = KVCacheManager(KVCacheConfig(20, [FullAttentionSpec(16), MambaSpec(16)]), 1024)
    a = Request("a", list(range(55)), 16)
    assert admit(m, a)[0].get_block_ids() == ([1, 2, 3, 4], [0, 0, 0, 5])
    m.new_step_starts()
    b = Request("b", list(range(48)) + [999] * 10, 16)
    assert m.get_computed_blocks(b)[1] == 0
    check_invariants(m)


def test_lora_prefix_identity_includes_the_adapter_path():
    """Re-pointing a LoRA name at another adapter must not serve the old adapter's KV (before: the
    name alone keyed the blocks), in kvservice's spec and in vLLM's."""
    for spec in (None, HashSpec("sha256", block_size=4)):
        m = KVCacheManager(KVCacheConfig(20, [FullAttentionSpec(4)]), 64)
        old = Request("old", list(range(13)), 4, lora_name="ad", lora_path="/v1", hash_spec=spec)
        admit(m, old)
        moved = Request("moved", list(range(13)), 4, lora_name="ad", lora_path="/v2", hash_spec=spec)
        same = Request("same", list(range(13)), 4, lora_name="ad", lora_path="/v1", hash_spec=spec)
        assert m.get_computed_blocks(moved)[1] == 0
        assert m.get_computed_blocks(same)[1] == 12
