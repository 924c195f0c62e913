"""vLLM 0.33.0 features of the core through kvservice's own API (vLLM's own suite runs them through
the drop-in: make test-vllm). Exact block ids, as the rest of the core's tests."""

import subprocess
import sys

from kvservice.core import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    MambaSpec,
    Request,
    SlidingWindowSpec,
)
from kvservice.core.invariants import check_invariants
from tests.core_helpers import admit


def manager(num_blocks, *specs, **kw):
    return KVCacheManager(KVCacheConfig(num_blocks, list(specs)), 256, **kw)


def test_core_imports_no_vllm_grpc_or_io():
    code = ("import sys, kvservice.core, kvservice.hashing; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'grpc', 'redis', 'torch', 'socket'));"
            "print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_full_sequence_gate_reserved_blocks_and_watermark():
    m = manager(11, FullAttentionSpec(4), watermark=0.2)  # 10 usable, watermark 2 blocks
    assert m.watermark_blocks == 2
    long = Request("long", list(range(40)), 4)
    # The first chunk fits, the whole prompt (10 blocks + the watermark) does not.
    assert m.allocate_slots(long, 8, full_sequence_must_fit=True) is None
    assert m.allocate_slots(long, 8, has_scheduled_reqs=False).get_block_ids() == ([1, 2],)
    short = Request("short", list(range(100, 124)), 4)
    assert m.allocate_slots(short, 24, reserved_blocks=3) is None  # 6 + 2 > 8 - 3
    assert m.allocate_slots(short, 24).get_block_ids() == ([3, 4, 5, 6, 7, 8],)
    check_invariants(m)


def test_blocks_to_allocate_is_allocate_slots_count_read_only():
    m = manager(20, FullAttentionSpec(4))
    admit(m, Request("a", list(range(12)), 4))
    b = Request("b", list(range(14)), 4)
    hits, n = m.get_computed_blocks(b)
    assert n == 12 and m.num_blocks_needed(b, 2, n, hits) == 1
    assert m.num_blocks_needed(b, 6, n, hits, num_tokens=18) == 2  # a planner's view after appending 4
    assert m.allocate_slots(b, 2, n, hits).get_block_ids() == ([4],)


def test_skip_reading_prefix_cache_and_shared_prefix_boundary():
    m = manager(20, FullAttentionSpec(4))
    admit(m, Request("a", list(range(12)), 4))
    b = Request("b", list(range(12)), 4)
    b.skip_reading_prefix_cache = True  # e.g. prompt logprobs: nothing hits, nothing counted
    assert m.find_computed_blocks(b) == (m.empty_kv_cache_blocks, 0, 0)
    c = Request("c", list(range(12)), 4)
    blocks, hit, boundary = m.find_computed_blocks(c)
    assert hit == 8 and blocks.get_block_ids() == ([1, 2],) and boundary == 0


def test_eagle_drops_the_last_hit_block():
    m = manager(20, FullAttentionSpec(4), use_eagle=True)
    assert m.fast_path is None  # EAGLE changes hits: the general path only
    admit(m, Request("a", list(range(16)), 4))
    hits, n = m.get_computed_blocks(Request("b", list(range(16)), 4))
    assert n == 8 and hits.get_block_ids() == ([1, 2],)  # 12 matched, the last block recomputed


def test_new_block_ids_for_zeroing_and_blocks_for_free():
    m = manager(20, FullAttentionSpec(4), SlidingWindowSpec(4, 4), MambaSpec(4))
    assert m.config.needs_kv_cache_zeroing  # a Mamba group: new attention blocks are zeroed
    a = Request("a", list(range(9)), 4)
    new, _ = admit(m, a)
    assert new.get_block_ids() == ([1, 2, 3], [4, 5, 6], [0, 0, 7])
    assert m.take_new_block_ids() == [1, 2, 3, 4, 5, 6] and m.take_new_block_ids() == []
    assert [b.block_id for b in m.pop_blocks_for_free(a)] == [1, 2, 3, 4, 5, 6, 7]
    assert m.get_block_ids("a") == ([], [], [])


def test_get_block_ids_with_group_selection():
    m = manager(20, FullAttentionSpec(4), SlidingWindowSpec(4, 4))
    new, _ = admit(m, Request("a", list(range(5)), 4))
    assert new.get_block_ids(group_ids=[1]) == ([3, 4],)
    assert m.empty_kv_cache_blocks.get_block_ids(allow_none=True) is None
