"""The core's fast paths (`manager.fast_path`: allocate_running_batch, used by DecodeBatchOp and by decode
AllocateOps; admit, used by admissions) against the general path: random traces through two allocators,
one with the fast paths and one with them switched off (`AllocatorSettings.fast_path`), must give equal
replies and equal state (block for block, free-queue order, index, events) after every step."""

import random
import zlib
from array import array

import pytest

from kvservice.allocator import Allocator
from kvservice.allocator.keys import client_request_id
from kvservice.commands import PoolSpec
from kvservice.core import FullAttentionSpec, KVCacheConfig, KVCacheManager, PackedRows, Request, SlidingWindowSpec
from kvservice.core.invariants import check_invariants
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp, ForkOp, FreeOp, OpStatus
from kvservice.store.snapshot import state_digest
from tests.allocator_helpers import InProcess
from tests.core_helpers import admit, full_manager, pool_state

CASES = {
    "full bs4": dict(groups=[FullAttentionSpec(4)], blocks=40, max_len=96, dcp=1, caching=True),
    "full bs4 tiny pool": dict(groups=[FullAttentionSpec(4)], blocks=14, max_len=64, dcp=1, caching=True),
    "full bs4 dcp2": dict(groups=[FullAttentionSpec(4)], blocks=30, max_len=96, dcp=2, caching=True),
    "full bs8 no caching": dict(groups=[FullAttentionSpec(8)], blocks=24, max_len=96, dcp=1, caching=False),
    "full+sw (general only)": dict(groups=[FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=8)],
                                   blocks=40, max_len=96, dcp=1, caching=True),
}


def make(fast: bool, case, quota_tenant=False):
    a = Allocator(hash_block_size=4, quotas={"q": 1000} if quota_tenant else {}, fast_path=fast)
    d = InProcess(a, tenant="q" if quota_tenant else "")
    spec = PoolSpec("p", KVCacheConfig(case["blocks"], case["groups"]), case["max_len"], dcp_world_size=case["dcp"],
                    enable_caching=case["caching"])
    d.register(spec)
    return a, d


def random_ops(rng: random.Random, live: dict[str, int], next_id: list[int], max_len: int) -> list:
    """One Step's ops; `live` maps request ids to their token counts as the trace believes them."""
    kind = rng.random()
    family = [rng.randrange(50) for _ in range(24)]
    if kind < 0.25 or not live:
        ops = []
        for _ in range(rng.randint(1, 3)):
            rid = f"r{next_id[0]}"
            next_id[0] += 1
            prompt = family[:rng.randint(4, 24)] + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
            # Admissions, whole or chunked, some with lookahead or delayed caching (the core's admit path).
            ops += [AddRequestOp(rid, token_ids=prompt),
                    AllocateOp(rid, num_new_tokens=rng.choice([len(prompt), len(prompt), rng.randint(1, len(prompt))]),
                               num_lookahead_tokens=rng.choice([0, 0, 0, 3]), delay_cache_blocks=rng.random() < 0.1)]
            live[rid] = len(prompt)
        return ops
    if kind < 0.32:
        parent = rng.choice(sorted(live))
        child = f"r{next_id[0]}"
        next_id[0] += 1
        live[child] = live[parent]
        return [ForkOp(parent, child)]
    if kind < 0.40:
        rid = rng.choice(sorted(live))
        del live[rid]
        return [FreeOp(rid)]
    ids = rng.sample(sorted(live), rng.randint(1, len(live)))
    if rng.random() < 0.1:
        ids.insert(rng.randrange(len(ids) + 1), "nobody")
    computed = []
    for rid in ids:
        n = live.get(rid, 0)
        c = rng.choice([n, n, n, n, max(0, n - rng.randint(1, 5)), n + 1, n + 2])
        computed.append(c)
    with_tokens = rng.random() < 0.85
    tokens = array("I", [rng.randrange(50) for _ in ids]) if with_tokens else None
    budget = rng.choice([1, 1, 1, 2, 5])
    lookahead = rng.choice([0, 0, 0, 1, 3])
    if rng.random() < 0.5:
        return [DecodeBatchOp(ids, array("I", computed), tokens, budget, lookahead)]
    return [AllocateOp(rid, num_computed_tokens=c, num_new_tokens=budget,
                       append_token_ids=None if tokens is None else [tokens[i]], num_lookahead_tokens=lookahead)
            for i, (rid, c) in enumerate(zip(ids, computed))]


def sync_live(a: Allocator, live: dict[str, int]) -> None:
    """What the allocator holds is the truth the next ops are drawn from."""
    held = {client_request_id(key): req.num_tokens for key, req in a.pool("p").requests.items()}
    for rid in list(live):
        if rid in held:
            live[rid] = held[rid]
        else:
            del live[rid]


@pytest.mark.parametrize("quota", [False, True], ids=["no quota", "tenant quota"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_path_equals_general_path(case, quota):
    cfg = CASES[case]
    fast, s1 = make(True, cfg, quota)
    slow, s2 = make(False, cfg, quota)
    rng = random.Random(zlib.crc32(f"{case}/{quota}".encode()))
    live: dict[str, int] = {}
    next_id = [0]
    outcomes = set()
    seen = 1
    for step in range(400):
        ops = random_ops(rng, live, next_id, cfg["max_len"])
        r1 = s1.step("p", ops)
        r2 = s2.step("p", ops)
        assert r1 == r2, f"step {step}: {ops}"
        for r in r1.results:
            outcomes.add(r.status)
            if r.batch is not None:
                outcomes.update(OpStatus(x) for x in r.batch.statuses)
        assert [(e.sequence, e.event) for e in fast.state.events.since(seen)] == \
            [(e.sequence, e.event) for e in slow.state.events.since(seen)]
        seen = fast.state.events.next_sequence
        assert state_digest(fast) == state_digest(slow), f"step {step}: {ops}"
        assert fast.invariant_violation(fast.pool("p")) == ""
        sync_live(fast, live)
    # The traces reach the cases that matter: successes, no space or rejected entries, missing requests.
    assert OpStatus.OK in outcomes and OpStatus.NOT_FOUND in outcomes
    assert outcomes & {OpStatus.NO_SPACE, OpStatus.FAILED_PRECONDITION}


def test_allocate_running_matches_allocate_slots_and_declines_what_it_cannot_take():
    def pair():
        out = []
        for fast in (True, False):
            m = full_manager(12, block_size=4, max_model_len=40, enable_fast_path=fast)
            r = Request("a", list(range(7)), 4)
            admit(m, r)
            out.append((m, r))
        return out

    (m1, r1), (m2, r2) = pair()
    assert m2.fast_path is None
    for t in range(9):  # across two block boundaries (hashing and caching a full block included)
        new = m1.fast_path.allocate_running(r1, r1.num_tokens, 100 + t)
        r2.append_output_token_ids([100 + t])
        r2.num_computed_tokens = r2.num_tokens - 1
        ref = m2.allocate_slots(r2, 1)
        assert [b.block_id for b in new] == ref.get_block_ids()[0]
        assert pool_state(m1) == pool_state(m2) and r1.block_hashes == r2.block_hashes
        assert m1.take_events() == m2.take_events()
    check_invariants(m1)

    def unchanged(m, r, computed, token):
        before = pool_state(m), r.num_tokens, r.num_computed_tokens, list(r.block_hashes)
        assert m.fast_path.allocate_running(r, computed, token) is None
        assert (pool_state(m), r.num_tokens, r.num_computed_tokens, list(r.block_hashes)) == before

    # Declined, nothing changed: not running, nothing to compute, a bad token, past max_model_len,
    # a shared block to write, too few free blocks.
    unchanged(m1, Request("b", [1, 2, 3], 4), 0, 5)
    unchanged(m1, r1, r1.num_tokens, None)
    unchanged(m1, r1, r1.num_tokens + 1, 5)
    unchanged(m1, r1, r1.num_tokens, -1)
    m = full_manager(12, block_size=4, max_model_len=40)
    long = Request("c", list(range(39)), 4)
    admit(m, long)
    assert m.fast_path.allocate_running(long, 39, 1) == []  # the 40th token fits max_model_len 40 (block 10 has room)
    unchanged(m, long, 40, 1)  # a 41st would not
    m = full_manager(12, block_size=4)
    p = Request("p", list(range(6)), 4)
    admit(m, p)
    m.fork(p, "child")
    unchanged(m, p, 6, 7)  # its last block is shared: copy-on-write (the general path) decides
    m = full_manager(4, block_size=4)
    q = Request("q", list(range(12)), 4)
    admit(m, q)
    unchanged(m, q, 12, 7)  # block 4 of a 3-usable-block pool


def test_batch_stops_at_the_first_entry_it_cannot_take():
    m = full_manager(12, block_size=4, max_model_len=64)
    reqs = [Request(f"r{i}", list(range(10 * i, 10 * i + 5)), 4) for i in range(3)]
    for r in reqs:
        admit(m, r)
    out = PackedRows()
    batch = [reqs[0], None, reqs[2]]
    computed = [5, 0, 5]
    assert m.fast_path.allocate_running_batch(batch, computed, [1, 2, 3], 1, 0, 0, out) == 1
    assert list(out.num_computed) == [5] and reqs[0].num_tokens == 6
    assert m.fast_path.allocate_running_batch(batch, computed, [1, 2, 3], 1, 0, 2, out) == 3
    assert list(out.num_computed) == [5, 5] and list(out.num_scheduled) == [1, 1] and reqs[2].num_tokens == 6
    assert reqs[1].num_tokens == 5  # the skipped entry was not touched
    sw = KVCacheManager(KVCacheConfig(12, [FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=8)]), 64)
    assert sw.fast_path is None  # another layout: the general path only
    assert KVCacheManager(KVCacheConfig(12, [SlidingWindowSpec(4, sliding_window=8)]), 64).fast_path is None


@pytest.mark.parametrize("seed", range(8))
def test_admit_equals_get_computed_blocks_then_allocate_slots(seed):
    """FastPath.admit against the two calls it stands for (on a manager with the fast path off), on random
    admissions and frees of prompts sharing prefixes in a pool that fills up: cached-free hits to rescue,
    evictions, NO_SPACE, delayed caching and duplicate hashes (a delayed request cached after an equal one)."""
    rng = random.Random(seed)
    num_blocks = rng.choice([10, 16, 30])
    fast, slow = (full_manager(num_blocks, block_size=4, max_model_len=64, enable_events=True, enable_fast_path=on)
                  for on in (True, False))
    families = [[rng.randrange(20) for _ in range(40)] for _ in range(3)]
    live: list[tuple[Request, Request]] = []
    delayed: list[tuple[Request, Request, int]] = []  # and the tokens they hold
    outcomes = set()
    for step in range(300):
        roll = rng.random()
        if live and roll < 0.3:
            a, b = live.pop(rng.randrange(len(live)))
            fast.free(a)
            slow.free(b)
            delayed[:] = [d for d in delayed if d[0] is not a]
        elif delayed and roll < 0.4:
            a, b, num_scheduled = delayed.pop()
            fast.cache_blocks(a, num_scheduled)
            slow.cache_blocks(b, num_scheduled)
        else:
            prompt = rng.choice(families)[:rng.randint(1, 40)] + [rng.randrange(20) for _ in range(rng.randint(0, 5))]
            budget = rng.choice([len(prompt), len(prompt), rng.randint(1, len(prompt))])
            lookahead, delay = rng.choice([0, 0, 0, 3]), rng.random() < 0.15
            a, b = Request(f"r{step}", prompt, 4), Request(f"r{step}", prompt, 4)
            if rng.random() < 0.2:
                a.num_preemptions = b.num_preemptions = 1  # counted apart in the stats
            got = fast.fast_path.admit(a, budget, lookahead, delay)
            hits, num_hit = slow.get_computed_blocks(b)
            new = slow.allocate_slots(b, min(budget, b.num_tokens - num_hit), num_hit, hits, lookahead, delay)
            assert got is not None and got[1] == num_hit
            if new is None:
                assert got[0] is None
                outcomes.add("no space")
            else:
                assert [block.block_id for block in got[0]] == slow.get_block_ids(b.request_id)[0]
                outcomes.add("hit" if num_hit else "miss")
                live.append((a, b))
                if delay:
                    delayed.append((a, b, num_hit + min(budget, b.num_tokens - num_hit)))
        assert pool_state(fast) == pool_state(slow), f"step {step}"
        assert fast.take_events() == slow.take_events()
        assert fast.make_prefix_cache_stats() == slow.make_prefix_cache_stats()
        assert fast.prefix_cache_totals == slow.prefix_cache_totals
        check_invariants(fast)
    assert outcomes == {"hit", "miss", "no space"}


def test_admit_declines_what_it_cannot_take():
    m = full_manager(12, block_size=4)
    r = Request("a", list(range(9)), 4)
    before = pool_state(m)
    assert m.fast_path.admit(r, 0) is None and m.fast_path.admit(r, 9, -1) is None  # bad counts: the general path
    r.num_computed_tokens = 4
    assert m.fast_path.admit(r, 5) is None  # not a fresh admission
    r.num_computed_tokens = 0
    assert m.fast_path.admit(Request("b", [1], 8), 1) is None  # hashed at another block size
    assert pool_state(m) == before and m.prefix_cache_totals.queries == 0
    assert m.fast_path.admit(r, 9)[0] is not None and m.fast_path.admit(r, 9) is None  # it holds blocks now
    for manager in (full_manager(12, block_size=4, enable_caching=False), full_manager(12, block_size=8,
                                                                                       hash_block_size=4)):
        assert manager.fast_path.admit(Request("c", [1, 2, 3], 4), 3) is None  # the general path's cases
