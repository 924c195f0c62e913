"""The global index's Lookup against the per-pool path it replaced (kept as the reference, `lookup_index` off),
on randomized fleets driven through the allocator's commands: tenants (namespaces) and an admin; pools in
kvservice's chain, in another hash spec (sha256), with hybrid groups (a sliding window beside full attention),
blocks larger than hash blocks, EAGLE, caching off; suspended pools; epochs that restart (retired maps),
prefix-cache resets, pools dropped; external pools fed vLLM-shaped KV events (GPU only, a CPU tier beside,
blocks of two hash blocks), resets among them. After every step, every Lookup (by tokens, by hashes, of a
subset of pools, by each tenant) is answered identically by both paths: hits, their order, and best_pool."""

from __future__ import annotations

import random

import msgpack
import pytest

from kvservice.allocator import Allocator
from kvservice.commands import IngestEvents, RegisterExternalPool, RegisterPool, VllmOptions
from kvservice.commands import PoolSpec as Spec
from kvservice.core import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from kvservice.external.spec import ExternalSpec
from kvservice.hashing import HashSpec
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp, OpStatus, ResetPrefixCacheOp
from tests.allocator_helpers import InProcess

BS = 16
TENANTS = ["", "t1", "t2"]


def configs(rng: random.Random) -> list[tuple[str, dict]]:
    """(kind, PoolSpec keyword arguments) of one fleet's pools."""
    n = rng.randint(3, 6)
    out = [("plain", {}) for _ in range(n)]
    out += [
        ("big-blocks", {"config": KVCacheConfig(24, [FullAttentionSpec(2 * BS)])}),
        ("hybrid", {"config": KVCacheConfig(40, [FullAttentionSpec(BS), SlidingWindowSpec(BS, 2 * BS)])}),
        ("sha256", {"hash_spec": HashSpec("sha256")}),
        ("no-caching", {"enable_caching": False}),
        ("eagle", {"vllm": VllmOptions(use_eagle=True)}),
        ("vllm", {"vllm": VllmOptions()}),
        ("dcp", {"dcp_world_size": 2}),
    ]
    return out


class Fleet:
    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.a = Allocator(hash_block_size=BS)
        self.sessions = {t: InProcess(self.a, f"s-{t or 'default'}", t) for t in TENANTS}
        self.families = [[rng.randrange(500) for _ in range(6 * BS)] for _ in range(4)]
        self.pools: dict[str, str] = {}  # pool id -> tenant
        self.live: dict[str, list[str]] = {}
        for i, (kind, kw) in enumerate(configs(rng)):
            tenant = rng.choice(TENANTS)
            pool_id = f"{kind}-{i}"
            kw.setdefault("config", KVCacheConfig(rng.choice([12, 24, 48]), [FullAttentionSpec(BS)]))
            register(self.sessions[tenant], Spec(pool_id, max_model_len=16 * BS, **kw))
            self.pools[pool_id], self.live[pool_id] = tenant, []
        self.externals = {}
        for j, shape in enumerate(["gpu", "gpu", "cpu-tier", "double"]):
            pool_id = f"ext-{shape}-{j}"
            self.a.apply(RegisterExternalPool(rng.choice(TENANTS), ExternalSpec(pool_id, f"tcp://127.0.0.1:{7000 + j}",
                                                                               max_blocks=40)), 0.0)
            self.externals[pool_id] = ExternalFeed(self.a, pool_id, shape, rng)
        self.n = 0

    def prompt(self) -> list[int]:
        rng = self.rng
        return rng.choice(self.families)[:rng.randrange(1, 6 * BS)] + [rng.randrange(500) for _ in
                                                                       range(rng.randrange(0, 3 * BS))]

    def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.25:
            feed = rng.choice(list(self.externals.values()))
            feed.publish(self.prompt())
            return
        pool_id = rng.choice(list(self.pools))
        s = self.sessions[self.pools[pool_id]]
        live = self.live[pool_id]
        if roll < 0.6 or not live:
            self.n += 1
            rid, prompt = f"r{self.n}", self.prompt()
            r = s.step(pool_id, [AddRequestOp(rid, token_ids=prompt), AllocateOp(rid, num_new_tokens=len(prompt))])
            if r.results[1].status == OpStatus.OK:
                live.append(rid)
            else:
                s.step(pool_id, [FreeOp(rid)])
        elif roll < 0.9:
            s.step(pool_id, [FreeOp(live.pop(rng.randrange(len(live))))])
        elif roll < 0.95:
            for rid in live:
                s.step(pool_id, [FreeOp(rid)])
            live.clear()
            s.step(pool_id, [ResetPrefixCacheOp()])
        else:  # the engine restarted: a new epoch (its requests fail, its old map is released)
            pool = self.a.state.pools[pool_id]
            register(s, pool.spec.with_epoch(pool.epoch + 1))
            live.clear()

    def suspend_some(self) -> None:
        for pool in self.a.state.pools.values():
            pool.suspended = self.rng.random() < 0.15


def register(s: InProcess, spec: Spec) -> None:
    fingerprint = spec.hash_spec.fingerprint() if spec.hash_spec else s.allocator.fingerprint
    s.allocator.apply(RegisterPool(s.session_id, s.tenant, s._sequence(), spec, fingerprint), s.now)


class ExternalFeed:
    """vLLM-shaped KV-event batches of one engine: BlockStored of prompts' full blocks, BlockRemoved of some."""

    def __init__(self, a: Allocator, pool_id: str, shape: str, rng: random.Random) -> None:
        self.a, self.pool_id, self.shape, self.rng = a, pool_id, shape, rng
        self.size = 2 * BS if shape == "double" else BS
        self.seq = 0
        self.held: dict[tuple, int] = {}  # block content path -> engine hash
        self.next_hash = 1

    def publish(self, prompt: list[int]) -> None:
        rng = self.rng
        events = []
        if self.held and rng.random() < 0.3:
            gone = rng.sample(list(self.held), k=min(len(self.held), rng.randint(1, 4)))
            events.append({"type": "BlockRemoved", "block_hashes": [self.held.pop(k) for k in gone],
                           "medium": "GPU", "group_idx": 0})
        if rng.random() < 0.05:
            events.append({"type": "AllBlocksCleared"})
            self.held.clear()
        n = len(prompt) // self.size
        if n:
            parent, chain = None, []
            for i in range(n):
                path = tuple(prompt[:(i + 1) * self.size])
                if path not in self.held:
                    self.held[path] = self.next_hash
                    self.next_hash += 1
                chain.append(self.held[path])
            k = rng.randrange(n)
            parent = chain[k - 1] if k else None
            medium = "CPU" if self.shape == "cpu-tier" and rng.random() < 0.5 else "GPU"
            events.append({"type": "BlockStored", "block_hashes": chain[k:], "parent_block_hash": parent,
                           "token_ids": prompt[k * self.size:n * self.size], "block_size": self.size,
                           "lora_id": None, "medium": medium, "lora_name": None, "extra_keys": None,
                           "group_idx": 0})
        payload = msgpack.packb([0.0, events, 0], use_bin_type=True)
        registration = self.a.state.external.pools[self.pool_id].registration
        reset = 2 if rng.random() < 0.03 else 0  # a resync: the index dropped first
        self.a.apply(IngestEvents(self.pool_id, registration, [(self.seq, payload)], reset), 0.0)
        self.seq += 1


def answers(a: Allocator, indexed: bool, tenant: str, admin: bool, **kw):
    a.state.settings.lookup_index = indexed
    try:
        r = a.lookup(tenant, admin=admin, **kw)
    finally:
        a.state.settings.lookup_index = True
    return r.hits, r.best_pool_id


@pytest.mark.parametrize("seed", range(12))
def test_the_index_answers_every_lookup_as_the_per_pool_path(seed):
    fleet = Fleet(seed)
    rng = fleet.rng
    a = fleet.a
    compared = hits = 0
    for step in range(160):
        fleet.step()
        if step % 40 == 39:
            fleet.suspend_some()
        for _ in range(3):
            tenant = rng.choice(TENANTS)
            admin = rng.random() < 0.3
            prompt = fleet.prompt()
            queries = [{"token_ids": prompt},
                       {"block_hashes": a.state.pools and next(iter(a.state.pools.values())).request_from_tokens(
                           "q", prompt).block_hashes, "num_tokens": len(prompt)}]
            if rng.random() < 0.3:
                visible = [p for p, t in fleet.pools.items() if admin or t == tenant]
                visible += [p for p, x in a.state.external.pools.items() if admin or x.owner_tenant == tenant]
                queries.append({"token_ids": prompt, "pool_ids": rng.sample(visible, k=min(len(visible), 3))})
            for q in queries:
                want = answers(a, False, tenant, admin, **q)
                got = answers(a, True, tenant, admin, **q)
                assert got == want, (seed, step, tenant, admin, q.keys())
                compared += 1
                hits += sum(h.num_cached_tokens > 0 for h in want[0])
    assert compared > 500 and hits > 100  # the fleets hit, not only miss
    assert a.placement.pool_index.members and a.placement.gpu_index.members  # both indexes answered


def test_members_of_gone_pools_leave_and_free_their_slots():
    """Epoch after epoch, the retired maps' keys lose their bits (they are cleared), and once gone pools'
    members outnumber the live pools they leave and their slots are reused: the index never holds a key no
    live pool holds, and its masks stay as wide as about twice the live pools."""
    fleet = Fleet(99)
    a = fleet.a
    s = fleet.sessions[""]
    spec = Spec("churn", KVCacheConfig(24, [FullAttentionSpec(BS)]), max_model_len=16 * BS)
    register(s, spec)
    bound = 2 * (len(a.state.pools) + len(a.state.external.pools)) + 16
    for epoch in range(1, 3 * bound):
        s.step("churn", [AddRequestOp(f"x{epoch}", token_ids=list(range(40))),
                         AllocateOp(f"x{epoch}", num_new_tokens=40)])
        assert a.lookup("", token_ids=list(range(40))).hits["churn"].num_cached_tokens == 32
        register(s, spec.with_epoch(epoch))
    index = a.placement.pool_index
    assert len(index.members) <= bound and index._next <= bound + 1  # slots reused, not one more per epoch
    held = set()
    for p in a.state.pools.values():
        held |= set(p.manager.block_pool.cached_block_hash_to_block.listened_keys())
    assert set(index.keys) <= held


def _best_pool_reference(hits, first_block_hash):
    """best_pool as it was written before its one-pass form (the rule, spelled out)."""
    hits = [h for h in hits if not h.suspended]
    if not hits:
        return ""
    best = max(h.num_cached_tokens for h in hits)
    tied = [h for h in hits if h.num_cached_tokens == best]
    empty = {h.pool_id: max(0, h.num_free_blocks - h.num_cached_blocks) for h in tied}
    most = max(empty.values())
    names = sorted(pool_id for pool_id, n in empty.items() if n == most)
    if len(names) == 1 or not first_block_hash:
        return names[0]
    return names[int.from_bytes(first_block_hash[:8], "big") % len(names)]


def test_best_pool_in_one_pass_is_the_rule():
    from kvservice.results import PoolHit, best_pool
    rng = random.Random(4)
    for _ in range(3000):
        n = rng.randint(0, 12)
        ids = rng.sample([f"p{i}" for i in range(20)], n)
        hits = [PoolHit(i, rng.choice([0, 16, 32, 48]), rng.randint(0, 8), rng.randint(0, 8),
                        suspended=rng.random() < 0.2) for i in ids]
        first = rng.choice([None, rng.randbytes(16)])
        assert best_pool(hits, first) == _best_pool_reference(hits, first)


def test_an_index_loaded_under_a_listener_announces_its_keys():
    """Loading an encoded index into one the global index listens to: reset() tells the listener each old key
    went, so the loaded keys must be told as they come, or Lookup would never find them through the index."""
    from kvservice.external.snapshot import encode_index, load_index

    fleet = Fleet(3)
    for _ in range(120):
        fleet.step()
    source = max((x.index for x in fleet.a.state.external.pools.values()), key=lambda i: len(i.listened_keys()))
    assert source.listened_keys()

    class Told:
        def __init__(self) -> None:
            self.keys: set[bytes] = set()

        def added(self, key: bytes) -> None:
            self.keys.add(key)

        def removed(self, key: bytes) -> None:
            self.keys.discard(key)

    target = next(x.index for x in fleet.a.state.external.pools.values() if x.index is not source)
    told = Told()
    target.listen(told)
    assert told.keys == set(target.listened_keys())
    load_index(target, encode_index(source))
    assert told.keys == set(source.listened_keys()) == set(target.listened_keys())
