"""A hybrid model's pool (full attention + Mamba, vLLM's "align" cache mode) with vLLM's semantics, over the
wire, its block ids checked against kvservice's core called directly as vLLM's scheduler calls its
KVCacheManager:

- step boundaries travel as NewStepOp: a Mamba state cached in a scheduler step is no prefix hit until the
  next step starts, however the scheduler's steps fall into Step RPCs (one Step may carry several steps;
  a step may span Steps);
- a KV connector's lookup (`connector_lookup`, vLLM's get_computed_blocks_for_connector): the full-attention
  hit, deeper than the Mamba states that survived, which the connector completes;
- the states cached in the step under way survive a snapshot (a restart mid-step hits exactly as before);
and bad input is refused naming the field, with the pool unchanged.
"""

import pytest

from kvservice.allocator.pools import VllmKVCacheManager
from kvservice.commands import VllmOptions
from kvservice.core import FullAttentionSpec, KVCacheConfig, MambaSpec, Request
from kvservice.core.managers import MambaManager
from kvservice.errors import InvalidArgument
from kvservice.hashing import HashSpec
from kvservice.ops import AddRequestOp, AllocateOp, EvictBlocksOp, FreeOp, NewStepOp, OpStatus
from tests.service_helpers import SMALL_HASH_BLOCK

BS = SMALL_HASH_BLOCK  # the hash block size of the small_hash_server fixture (conftest.py)
SPEC = HashSpec("sha256", None, BS)
MAX_LEN = 256
HYBRID = KVCacheConfig(40, [FullAttentionSpec(BS), MambaSpec(BS)])


@pytest.fixture
def client(small_hash_client):
    return small_hash_client


class Pair:
    """A hybrid pool on the server and the same pool in kvservice's core, driven op for op."""

    def __init__(self, client, pool_id: str, config: KVCacheConfig = HYBRID,
                 options: VllmOptions | None = None) -> None:
        self.client, self.pool_id = client, pool_id
        options = options or VllmOptions()
        client.register_pool(pool_id, config, max_model_len=MAX_LEN, hash_spec=SPEC, vllm=options)
        self.core = VllmKVCacheManager(config, MAX_LEN, True, hash_block_size=BS, enable_fast_path=False)
        for m in self.core.coordinator.single_type_managers:  # (as the allocator's Pool sets it)
            if isinstance(m, MambaManager):
                m.recache_keyed_tails = options.mamba_recache_keyed_tails
        self.requests: dict[str, Request] = {}
        self.refused: set[str] = set()  # admissions the core refused (NO_SPACE): the pool must too

    def add(self, request_id: str, tokens: list[int]) -> AddRequestOp:
        req = self.requests[request_id] = Request(request_id, tokens, BS, hash_spec=SPEC)
        return AddRequestOp(request_id, block_hashes=list(req.block_hashes), num_tokens=len(tokens))

    def admit(self, request_id: str, num_new: int | None = None, connector: bool = False,
              external: int = 0) -> AllocateOp:
        """The admission vLLM's scheduler makes of a waiting request (all of it, or `num_new` tokens), applied to
        the core; its op for the pool."""
        req = self.requests[request_id]
        if connector:
            blocks, hit, _, _ = self.core.get_computed_blocks_for_connector(req)
        else:
            blocks, hit, _ = self.core.find_computed_blocks(req, record_stats=False)
        new = req.num_tokens - hit - external if num_new is None else num_new
        req.waiting = True
        admitted = self.core.allocate_slots(req, new, hit, blocks, num_external_computed_tokens=external) is not None
        req.waiting = False
        if admitted:
            req.num_computed_tokens = hit + external + new
        else:
            self.refused.add(request_id)
        return AllocateOp(request_id, num_new_tokens=new, lookup=hit > 0, num_new_computed_tokens=hit, waiting=True,
                          num_external_computed_tokens=external, connector_lookup=connector and hit > 0)

    def run(self, request_id: str, num_new: int) -> AllocateOp:
        """A running request's next chunk, applied to the core; its op for the pool."""
        req = self.requests[request_id]
        op = AllocateOp(request_id, num_computed_tokens=req.num_computed_tokens, num_new_tokens=num_new)
        assert self.core.allocate_slots(req, num_new) is not None
        req.num_computed_tokens += num_new
        return op

    def step(self, ops: list) -> list:
        """One Step; each op's outcome is the core's (an admission it refused: NO_SPACE, else OK)."""
        results = self.client.step(self.pool_id, ops)
        for op, r in zip(ops, results):
            refused = isinstance(op, AllocateOp) and op.request_id in self.refused
            assert r.status == (OpStatus.NO_SPACE if refused else OpStatus.OK), (op, r)
        self.refused.clear()
        return results

    def check(self, *request_ids: str) -> None:
        """The pool agrees with the core: free blocks, tables, invariants."""
        s = self.client.get_stats(check_invariants=True).pools[self.pool_id]
        assert not s.invariant_violation, s.invariant_violation
        assert s.num_free_blocks == self.core.block_pool.get_num_free_blocks()
        for rid in request_ids:
            assert self.client.get_request(self.pool_id, rid).block_ids == self.core.get_block_ids(rid)


def seed(p: Pair, request_id: str, num_blocks: int) -> tuple[list[int], list[int]]:
    """A prefix prefilled one block per scheduler step (one Step each), so every boundary's Mamba state is
    cached; then freed. The full-attention and Mamba block ids, block by block."""
    tokens = list(range(1000, 1000 + num_blocks * BS))
    mamba = []
    for i in range(num_blocks):
        p.core.new_step_starts()
        ops = [NewStepOp(), p.add(request_id, tokens), p.admit(request_id, BS)] if i == 0 else \
            [NewStepOp(), p.run(request_id, BS)]
        p.step(ops)
        mamba.append(p.core.get_block_ids(request_id)[1][i])
    fa = p.core.get_block_ids(request_id)[0]
    p.check(request_id)
    p.core.free(p.requests[request_id])
    p.step([FreeOp(request_id)])
    return fa, mamba


def test_a_state_cached_in_a_step_hits_only_once_the_next_step_starts(client, request):
    p = Pair(client, request.node.name)
    prompt = list(range(40, 52))
    p.core.new_step_starts()
    # One Step: the step starts, `a` is admitted and caches its states.
    p.step([NewStepOp(), p.add("a", prompt), p.admit("a")])
    # The same scheduler step, another Step (an idle flush, or a step_interval_ms batch): `b` shares the
    # prompt, but the Mamba states `a` cached are not written yet, so neither finds them.
    # prompt: its hit (12 tokens) ends in a state this step writes, so its admission waits (NO_SPACE: vLLM's
    # way of deferring it to the next step), in the core and in the pool.
    ops = [p.add("b", prompt + [7]), p.admit("b")]
    assert ops[-1].num_new_computed_tokens == 12 and p.refused == {"b"}
    p.step(ops)
    p.check("a")
    # The next scheduler step starts (in the middle of a Step): `b` and `c` are admitted on that hit.
    p.core.new_step_starts()
    ops = [p.add("c", prompt + [8, 9]), NewStepOp(), p.admit("b"), p.admit("c")]
    assert ops[-1].num_new_computed_tokens == ops[-2].num_new_computed_tokens == 12 and not p.refused
    p.step(ops)
    p.check("a", "b", "c")


@pytest.mark.parametrize("recache", [False, True], ids=["vllm-0.33", "vllm-0.32"])
def test_a_tail_keyed_in_an_earlier_step_is_cached_again_only_under_vllm_0_32(client, request, recache):
    """vLLM 0.32's MambaManager caches a prompt tail again where a hit already keyed it, which marks it cached in
    this step: a third request hitting it in the same step waits a step. 0.33's skips it, and admits it."""
    p = Pair(client, request.node.name, options=VllmOptions(mamba_recache_keyed_tails=recache))
    prompt = list(range(40, 52))
    p.core.new_step_starts()
    p.step([NewStepOp(), p.add("a", prompt), p.admit("a")])
    p.core.new_step_starts()
    ops = [NewStepOp(), p.add("b", prompt + [7]), p.admit("b"), p.add("c", prompt + [8]), p.admit("c")]
    assert ops[2].num_new_computed_tokens == ops[4].num_new_computed_tokens == 12
    assert p.refused == ({"c"} if recache else set())
    p.step(ops)  # the pool refuses (NO_SPACE) exactly what the core refused
    p.check("a", "b")


def test_two_step_marks_in_a_row_are_one_and_steps_restart_nowhere_else(client, request):
    """Without NewStepOp a vLLM pool's Steps start no step: a Step of its own never makes a state hit."""
    p = Pair(client, request.node.name)
    prompt = list(range(60, 68))
    p.core.new_step_starts()
    p.step([NewStepOp(), NewStepOp(), p.add("a", prompt), p.admit("a")])
    for name in ("b", "c"):  # two more Steps, the same scheduler step: both wait
        ops = [p.add(name, prompt + [1]), p.admit(name)]
        assert p.refused == {name}
        p.step(ops)
    p.check("a")
    p.core.new_step_starts()
    p.step([NewStepOp(), NewStepOp(), p.admit("b")])
    p.check("a", "b")


def test_a_connector_lookup_takes_the_full_attention_hit_past_the_evicted_states(client, request):
    """vLLM's divergent hybrid hit: every Mamba state but the first evicted, the full-attention blocks kept; a
    connector that restores Mamba state takes the full-attention hit and loads one block more."""
    p = Pair(client, request.node.name)
    fa, mamba = seed(p, "fill", 4)
    evicted = mamba[1:]
    p.core.evict_blocks(evicted)
    p.step([EvictBlocksOp(evicted)])
    tokens = list(range(1000, 1000 + 6 * BS))
    p.core.new_step_starts()
    ops = [NewStepOp(), p.add("replay", tokens)]
    plain = Request("probe", tokens, BS, hash_spec=SPEC)
    assert p.core.find_computed_blocks(plain, record_stats=False)[1] == BS  # reconciled: block 0 only
    ops.append(p.admit("replay", connector=True, external=BS))
    assert ops[-1].num_new_computed_tokens == 4 * BS  # the full-attention hit
    (_, _, r) = p.step(ops)
    assert r.num_computed_tokens == 5 * BS
    p.check("replay")
    assert p.client.get_request(p.pool_id, "replay").block_ids[0][:4] == fa[:4]


def test_the_pool_refuses_a_connector_lookup_it_does_not_find(client, request):
    """A plain admission claiming the connector's deeper hit is refused (stale view), the pool unchanged."""
    p = Pair(client, request.node.name)
    _, mamba = seed(p, "fill", 4)
    p.core.evict_blocks(mamba[1:])
    p.step([EvictBlocksOp(mamba[1:])])
    tokens = list(range(1000, 1000 + 6 * BS))
    p.step([NewStepOp(), p.add("x", tokens)])
    before = p.client.get_stats().pools[p.pool_id].num_free_blocks
    (r,) = p.client.step(p.pool_id, [AllocateOp("x", num_new_tokens=4, lookup=True, num_new_computed_tokens=16,
                                                waiting=True, num_external_computed_tokens=4)])
    assert r.status != OpStatus.OK and "expected 16" in r.message
    assert p.client.get_stats().pools[p.pool_id].num_free_blocks == before


def test_bad_mamba_input_is_refused_naming_the_field(client, request):
    name = request.node.name
    for spec, field in ((MambaSpec(BS, "align", 65), r"mamba\.num_speculative_blocks.*65"),
                        (MambaSpec(BS, "align", 1, 2, 1), r"mamba\.num_prefill_checkpoint_blocks.*must be 0 or 1")):
        with pytest.raises(InvalidArgument, match=field):
            client.register_pool(name + "-spec", KVCacheConfig(20, [FullAttentionSpec(BS), spec]),
                                 max_model_len=MAX_LEN, hash_spec=SPEC, vllm=VllmOptions())
    assert name + "-spec" not in client.get_stats().pools
    with pytest.raises(InvalidArgument, match=r"mamba\.mamba_cache_mode.*'none'.*prefix caching needs 'align'"):
        client.register_pool(name + "-none", KVCacheConfig(20, [FullAttentionSpec(BS), MambaSpec(BS, "none")]),
                             max_model_len=MAX_LEN, hash_spec=SPEC, vllm=VllmOptions())
    # Without prefix caching "none" is what vLLM registers, and is kept.
    client.register_pool(name + "-off", KVCacheConfig(20, [FullAttentionSpec(BS), MambaSpec(BS, "none")]),
                         max_model_len=MAX_LEN, enable_caching=False, hash_spec=SPEC, vllm=VllmOptions())
    p = Pair(client, name)
    with pytest.raises(InvalidArgument, match=r"ops\[1\]\.allocate\.connector_lookup"):
        client.step(p.pool_id, [p.add("a", [1, 2, 3]), AllocateOp("a", num_new_tokens=3, connector_lookup=True)])
    assert client.get_stats().pools[p.pool_id].num_requests == 0  # nothing applied
    client.register_pool(name + "-plain", KVCacheConfig(20, [FullAttentionSpec(BS)]), max_model_len=MAX_LEN)
    with pytest.raises(InvalidArgument, match=r"ops\[0\]\.new_step.*vllm options"):
        client.step(name + "-plain", [NewStepOp()])


def test_recaching_keyed_tails_needs_a_mamba_group(client, request):
    with pytest.raises(InvalidArgument, match=r"vllm.mamba_recache_keyed_tails = True: only a pool with a Mamba "):
        client.register_pool(request.node.name, KVCacheConfig(16, [FullAttentionSpec(BS)]), max_model_len=MAX_LEN,
                             hash_spec=SPEC, vllm=VllmOptions(mamba_recache_keyed_tails=True))
    assert request.node.name not in client.get_stats().pools
