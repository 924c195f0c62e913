"""What a vLLM scheduler with a KV connector, speculative decoding or an encoder-decoder model asks of a pool
with vLLM's semantics, over the wire, with exact block ids checked against kvservice's core called directly
as vLLM's scheduler calls its KVCacheManager:

- an admission with a connector's tokens (`num_external_computed_tokens`), synchronous and asynchronous
  (no new tokens, `delay_cache_blocks`, then cached by a later `cache_tokens` once the load is done);
- vLLM's deferred free (`defer_block_free`): FreeOp(popped=True) frees in the order of pop_blocks_for_free
  followed by free_blocks(reversed(...)), which differs from a plain free with two groups;
- evict_blocks (a connector's failed loads): the blocks leave the prefix cache;
- remove_skipped_blocks at a connector's finished request: the window's settled blocks are freed then, in
  that place among the step's ops (their place in the free queue shows in the next allocation);
- cross attention: an encoder-decoder admission's encoder tokens get their static blocks;
- the pool options EAGLE's block drop and hash lookahead travel with RegisterPool;
and bad input is refused naming the field, with the pool unchanged.
"""

import pytest

from kvservice.allocator.pools import VllmKVCacheManager
from kvservice.commands import VllmOptions
from kvservice.core import CrossAttentionSpec, FullAttentionSpec, KVCacheConfig, Request, SlidingWindowSpec
from kvservice.errors import InvalidArgument
from kvservice.hashing import HashSpec
from kvservice.ops import AddRequestOp, AllocateOp, EvictBlocksOp, FreeOp, OpStatus, RemoveSkippedBlocksOp
from tests.service_helpers import SMALL_HASH_BLOCK

BS = SMALL_HASH_BLOCK  # the hash block size of the small_hash_server fixture (conftest.py)
SPEC = HashSpec("sha256", None, BS)
MAX_LEN = 256


def hashes(tokens: list[int]) -> list[bytes]:
    return Request("h", tokens, BS, hash_spec=SPEC).block_hashes


@pytest.fixture
def client(small_hash_client):
    return small_hash_client


class Pair:
    """A pool on the server and the same pool in kvservice's core, in this process."""

    def __init__(self, client, pool_id: str, config: KVCacheConfig, options: VllmOptions | None = None,
                 enable_caching: bool = True) -> None:
        self.client, self.pool_id = client, pool_id
        options = options or VllmOptions()
        client.register_pool(pool_id, config, max_model_len=MAX_LEN, enable_caching=enable_caching, hash_spec=SPEC,
                             vllm=options)
        self.core = VllmKVCacheManager(config, MAX_LEN, enable_caching, hash_block_size=BS, enable_fast_path=False,
                                       use_eagle=options.use_eagle,
                                       num_hash_lookahead_tokens=options.num_hash_lookahead_tokens,
                                       num_prefill_lookahead=options.num_prefill_lookahead)
        self.requests: dict[str, Request] = {}

    def add(self, request_id: str, tokens: list[int]) -> None:
        self.requests[request_id] = Request(request_id, tokens, BS, hash_spec=SPEC)
        (r,) = self.client.step(self.pool_id, [AddRequestOp(request_id, block_hashes=hashes(tokens),
                                                            num_tokens=len(tokens))])
        assert r.status == OpStatus.OK, r

    def stats(self):
        return self.client.get_stats(check_invariants=True).pools[self.pool_id]

    def free_blocks(self) -> int:
        return self.stats().num_free_blocks

    def state(self, request_id: str, prompt: list[int]) -> tuple:
        """What the pool shows of itself: its counts, a request's table and a prompt's hit."""
        s = self.stats()
        assert not s.invariant_violation, s.invariant_violation
        info = self.client.get_request(self.pool_id, request_id)
        return (s.num_free_blocks, s.num_cached_blocks, s.num_requests, info.block_ids, info.num_computed_tokens,
                self.client.lookup(prompt, pool_ids=[self.pool_id]).tokens(self.pool_id))


def test_a_connectors_tokens_are_allocated_after_the_local_hit(client, request):
    """Synchronous load: the admission's table covers the local hit, the connector's tokens and the new ones."""
    p = Pair(client, request.node.name, KVCacheConfig(32, [FullAttentionSpec(BS)]))
    prompt = list(range(20))
    p.add("a", prompt)
    (r,) = client.step(p.pool_id, [AllocateOp("a", num_new_tokens=4, waiting=True, num_external_computed_tokens=16)])
    req = p.requests["a"]
    new = p.core.allocate_slots(req, 4, num_external_computed_tokens=16)
    assert r.status == OpStatus.OK and r.num_computed_tokens == 16
    assert r.new_block_ids == p.core.get_block_ids("a") == ([1, 2, 3, 4, 5],) and new is not None
    # Computed, the connector's blocks are prefix hits for the next request (vLLM's hit stops a token short).
    assert client.lookup(prompt + [7], pool_ids=[p.pool_id]).tokens(p.pool_id) == 20
    assert p.free_blocks() == p.core.block_pool.get_num_free_blocks()


def test_an_asynchronous_load_is_cached_only_once_it_arrived(client, request):
    """vLLM's WAITING_FOR_REMOTE_KVS: blocks allocated with no new tokens and delay_cache_blocks; the
    scheduler caches them (cache_blocks) when the load finished."""
    p = Pair(client, request.node.name, KVCacheConfig(32, [FullAttentionSpec(BS)]))
    prompt = list(range(100, 113))
    p.add("a", prompt)
    (r,) = client.step(p.pool_id, [AllocateOp("a", num_new_tokens=0, waiting=True, delay_cache_blocks=True,
                                              num_external_computed_tokens=12)])
    p.core.allocate_slots(p.requests["a"], 0, 0, None, 0, True, num_external_computed_tokens=12)
    assert r.status == OpStatus.OK and r.new_block_ids == p.core.get_block_ids("a") == ([1, 2, 3],)
    assert client.lookup(prompt, pool_ids=[p.pool_id]).tokens(p.pool_id) == 0  # not loaded yet: no hit
    (r,) = client.step(p.pool_id, [AllocateOp("a", num_computed_tokens=12, cache_tokens=12, waiting=True)])
    assert r.status == OpStatus.OK
    assert client.lookup(prompt, pool_ids=[p.pool_id]).tokens(p.pool_id) == 12


def _two_group_pool(client, pool_id: str) -> Pair:
    return Pair(client, pool_id, KVCacheConfig(20, [FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)]))


def _admit_and_run(p: Pair, request_id: str, tokens: list[int]) -> None:
    p.add(request_id, tokens)
    (r,) = p.client.step(p.pool_id, [AllocateOp(request_id, num_new_tokens=len(tokens), waiting=True)])
    p.core.allocate_slots(p.requests[request_id], len(tokens))
    assert r.status == OpStatus.OK and r.new_block_ids == p.core.get_block_ids(request_id)


@pytest.mark.parametrize("popped", [True, False], ids=["deferred", "plain"])
def test_a_deferred_free_frees_in_vllms_deferred_order(client, request, popped):
    """Two groups: a plain free returns each group's blocks tail first, group by group; vLLM's deferred free
    returns all of them in one list, tail first. The next allocation shows which order the pool used."""
    p = _two_group_pool(client, f"{request.node.callspec.id}-{request.node.originalname}"[:60])
    _admit_and_run(p, "a", list(range(16)))
    (r,) = client.step(p.pool_id, [FreeOp("a", popped=popped)])
    assert r.status == OpStatus.OK
    req = p.requests.pop("a")
    if popped:
        p.core.block_pool.free_blocks(reversed(p.core.pop_blocks_for_free(req)))
    else:
        p.core.free(req)
    p.core.reset_prefix_cache()
    client.reset_prefix_cache([p.pool_id])
    _admit_and_run(p, "b", list(range(500, 536)))  # 18 blocks: 7 of them the freed ones, as the core has them
    assert p.free_blocks() == p.core.block_pool.get_num_free_blocks()


def test_the_two_free_orders_differ(client, request):
    """The deferred order is a different order (so the test above can fail): the same frees, both ways, hand
    the next request different blocks."""
    tables = []
    for popped in (True, False):
        p = _two_group_pool(client, f"{request.node.name}-{popped}")
        _admit_and_run(p, "a", list(range(16)))
        client.step(p.pool_id, [FreeOp("a", popped=popped)])
        client.reset_prefix_cache([p.pool_id])
        p.add("b", list(range(500, 536)))
        (r,) = client.step(p.pool_id, [AllocateOp("b", num_new_tokens=36, waiting=True)])
        tables.append(r.new_block_ids)
    assert tables[0] != tables[1]


def test_evicted_blocks_leave_the_prefix_cache(client, request):
    p = Pair(client, request.node.name, KVCacheConfig(32, [FullAttentionSpec(BS)]))
    prompt = list(range(300, 316))
    _admit_and_run(p, "a", prompt)
    client.step(p.pool_id, [FreeOp("a")])
    assert client.lookup(prompt + [1], pool_ids=[p.pool_id]).tokens(p.pool_id) == 16
    blocks = p.core.get_block_ids("a")[0]
    (r,) = client.step(p.pool_id, [EvictBlocksOp([blocks[2]])])  # the third block: the hit stops before it
    assert r.status == OpStatus.OK
    assert client.lookup(prompt + [1], pool_ids=[p.pool_id]).tokens(p.pool_id) == 8


def test_bad_evictions_and_deferred_frees_are_refused_naming_the_field(client, request):
    p = Pair(client, request.node.name, KVCacheConfig(32, [FullAttentionSpec(BS)]))
    _admit_and_run(p, "a", list(range(12)))
    before = p.state("a", list(range(13)))
    for ids, bad in (([0], 0), ([3, 32], 32)):
        with pytest.raises(InvalidArgument, match=rf"ops\[1\]\.evict_blocks\.block_ids.*{bad}"):
            client.step(p.pool_id, [FreeOp("a"), EvictBlocksOp(ids)])
    assert p.state("a", list(range(13))) == before  # the FreeOp before the bad op was not applied either
    client.register_pool("plain-" + request.node.name[:40], KVCacheConfig(8, [FullAttentionSpec(BS)]),
                         max_model_len=MAX_LEN)
    with pytest.raises(InvalidArgument, match=r"ops\[0\]\.free\.popped"):
        client.step("plain-" + request.node.name[:40], [FreeOp("x", popped=True)])
    with pytest.raises(InvalidArgument, match=r"ops\[0\]\.allocate\.num_external_computed_tokens.*257"):
        client.step(p.pool_id, [AllocateOp("a", num_new_tokens=1, num_external_computed_tokens=MAX_LEN + 1)])
    assert p.state("a", list(range(13))) == before


def test_settled_window_blocks_are_freed_where_the_scheduler_frees_them(client, request):
    """vLLM frees a finished request's out-of-window blocks before its connector gets the table, and the
    whole request later: the window's blocks reach the free queue first, so later blocks come back first."""
    p = _two_group_pool(client, request.node.name)
    _admit_and_run(p, "a", list(range(16)))
    (r,) = client.step(p.pool_id, [RemoveSkippedBlocksOp("a", 16)])
    p.core.remove_skipped_blocks("a", 16, 16)
    assert r.status == OpStatus.OK
    table = client.get_request(p.pool_id, "a").block_ids
    assert table == p.core.get_block_ids("a") and table[1][:2] == [0, 0]  # below the window: null
    assert p.free_blocks() == p.core.block_pool.get_num_free_blocks()
    client.step(p.pool_id, [FreeOp("a")])
    p.core.free(p.requests.pop("a"))
    client.reset_prefix_cache([p.pool_id])
    p.core.reset_prefix_cache()
    _admit_and_run(p, "b", list(range(500, 536)))  # the freed blocks, in the core's order


def test_bad_settled_window_frees_are_refused_naming_the_field(client, request):
    p = _two_group_pool(client, request.node.name)
    _admit_and_run(p, "a", list(range(12)))
    before = p.state("a", list(range(13)))
    with pytest.raises(InvalidArgument, match=r"ops\[1\]\.remove_skipped_blocks\.processed_computed_tokens.*257"):
        client.step(p.pool_id, [FreeOp("a"), RemoveSkippedBlocksOp("a", MAX_LEN + 1)])
    with pytest.raises(InvalidArgument, match=r"ops\[0\]\.remove_skipped_blocks\.request_id"):
        client.step(p.pool_id, [RemoveSkippedBlocksOp("", 4)])
    (r,) = client.step(p.pool_id, [RemoveSkippedBlocksOp("nobody", 4)])
    assert r.status == OpStatus.NOT_FOUND
    assert p.state("a", list(range(13))) == before
    plain = "plain-" + request.node.name[:40]
    client.register_pool(plain, KVCacheConfig(8, [FullAttentionSpec(BS)]), max_model_len=MAX_LEN)
    with pytest.raises(InvalidArgument, match=r"ops\[0\]\.remove_skipped_blocks.*vllm options"):
        client.step(plain, [RemoveSkippedBlocksOp("x", 4)])


def test_an_encoder_decoder_admission_gets_its_cross_attention_blocks(client, request):
    # vLLM turns prefix caching off for encoder-decoder models (cross-attention blocks are never cached).
    p = Pair(client, request.node.name, KVCacheConfig(40, [FullAttentionSpec(BS), CrossAttentionSpec(BS)]),
             enable_caching=False)
    p.add("a", list(range(8)))
    (r,) = client.step(p.pool_id, [AllocateOp("a", num_new_tokens=8, waiting=True, num_encoder_tokens=10)])
    p.core.allocate_slots(p.requests["a"], 8, num_encoder_tokens=10)
    assert r.status == OpStatus.OK and r.new_block_ids == p.core.get_block_ids("a")
    assert len(r.new_block_ids[1]) == 3  # ceil(10 / 4) cross-attention blocks


def test_eagle_and_hash_lookahead_options_reach_the_pool(client, request):
    """With EAGLE's block drop a full hit gives back its last block; the registered pool does as the core does."""
    for use_eagle in (False, True):
        p = Pair(client, f"{request.node.name}-{use_eagle}", KVCacheConfig(32, [FullAttentionSpec(BS)]),
                 VllmOptions(use_eagle=use_eagle))
        prompt = list(range(700, 717))
        _admit_and_run(p, "a", prompt)
        client.step(p.pool_id, [FreeOp("a")])
        p.core.free(p.requests.pop("a"))
        p.add("b", prompt)
        blocks, hit = p.core.get_computed_blocks(p.requests["b"])
        assert hit == (12 if use_eagle else 16)
        (r,) = client.step(p.pool_id, [AllocateOp("b", num_new_tokens=len(prompt) - hit, lookup=True,
                                                  num_new_computed_tokens=hit, waiting=True)])
        assert r.status == OpStatus.OK, r


def test_mtp_prefill_lookahead_reaches_the_pool(client, request):
    """vLLM's num_prefill_lookahead_tokens (an MTP drafter reads the next prompt tokens): the last L - 1 computed
    tokens are re-prefilled, so they are not cached yet; the registered pool caches as the core does."""
    prompt = list(range(800, 816))
    for lookahead, cached in ((0, 16), (3, 12)):
        p = Pair(client, f"{request.node.name}-{lookahead}", KVCacheConfig(32, [FullAttentionSpec(BS)]),
                 VllmOptions(num_prefill_lookahead=lookahead))
        _admit_and_run(p, "a", prompt)
        probe = Request("probe", prompt + [1], BS, hash_spec=SPEC)
        assert p.core.get_computed_blocks(probe)[1] == cached
        assert client.lookup(prompt + [1], pool_ids=[p.pool_id]).tokens(p.pool_id) == cached


def test_a_capped_hit_is_checked_against_the_same_cap(client, request):
    """An auxiliary-output connector caps a hit (vLLM's max_cache_hit_length): the pool looks the hit up with
    the cap the scheduler used, so the admission is accepted as scheduled, never refused a step late."""
    p = Pair(client, request.node.name, KVCacheConfig(32, [FullAttentionSpec(BS)]))
    prompt = list(range(900, 917))
    _admit_and_run(p, "a", prompt)
    client.step(p.pool_id, [FreeOp("a")])
    p.add("b", prompt)
    blocks, hit = p.core.find_computed_blocks(p.requests["b"], 8, record_stats=False)[:2]
    assert hit == 8
    admission = dict(num_new_tokens=len(prompt) - hit, lookup=True, num_new_computed_tokens=hit, waiting=True)
    (r,) = client.step(p.pool_id, [AllocateOp("b", **admission)])  # uncapped, the pool has 16 cached
    assert r.status == OpStatus.FAILED_PRECONDITION and "has 16 of its tokens cached" in r.message
    (r,) = client.step(p.pool_id, [AllocateOp("b", **admission, max_cache_hit_length=8)])
    assert r.status == OpStatus.OK and r.num_computed_tokens == 8 and len(r.new_block_ids[0]) == 5
