"""Sharded allocators (issue 18) on loopback, over a Redis Cluster of 3 masters (Debian's redis-server 7):
3 shards, each with a hot standby; random multi-pool workloads through one client; a shard leader killed
under load (its standby takes over, nothing acknowledged lost, the other shards keep serving); a zombie
leader fenced; a rebalance under load; a cross-shard transfer with either side killed mid-way."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvservice.client import KVServiceClient
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp, ExternalSource, FreeOp, OpStatus, PinOp, UnpinOp
from tests.cluster_helpers import RedisCluster, cluster_available, start_shard
from tests.service_helpers import REPO

pytestmark = pytest.mark.skipif(not cluster_available(), reason="needs Debian's redis-server and redis-cli "
                                                                 "(make install installs them)")
CONFIG = KVCacheConfig(129, [FullAttentionSpec(16)])
SHARDS = ("s0", "s1", "s2")


class Deployment:
    """3 shard leaders and their standbys, each a `kvservice serve` process."""

    def __init__(self, tmp_path, namespace: str) -> None:
        self.tmp = tmp_path
        self.cluster = RedisCluster(tmp_path / "redis").start()
        self.namespace = namespace
        self.leaders = {s: self.start(s) for s in SHARDS}
        self.standbys = {s: self.start(s, "--standby") for s in SHARDS}

    def start(self, shard: str, *args: str):
        return start_shard(self.cluster.url, shard, self.tmp, "--leader-lease", "1", *args,
                           namespace=self.namespace)

    def client(self, **kw) -> KVServiceClient:
        seeds = ",".join(p.target for p in self.leaders.values())
        return KVServiceClient(seeds, failover_timeout_s=30, **kw)

    def stop(self) -> None:
        for proc in [*self.leaders.values(), *self.standbys.values()]:
            proc.stop()
        self.cluster.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("sharded"), "shard-tests")
    yield d
    d.stop()


class Worker(threading.Thread):
    """Random admissions, decodes and frees over several pools; remembers what was acknowledged."""

    def __init__(self, client: KVServiceClient, pools: list[str], seed: int) -> None:
        super().__init__(daemon=True)
        self.client, self.pools, self.rng = client, pools, random.Random(seed)
        self.name_prefix = f"w{seed}"  # request ids unique per worker (two workers share the pools)
        self.tokens: dict[tuple[str, str], int] = {}  # (pool, request) -> acknowledged tokens
        self.steps: dict[str, int] = {p: 0 for p in pools}
        self.stop_now = threading.Event()
        self.error: BaseException | None = None
        self.n = 0

    def run(self) -> None:
        try:
            while not self.stop_now.is_set():
                self.one()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def one(self) -> None:
        pool = self.rng.choice(self.pools)
        live = sorted(rid for p, rid in self.tokens if p == pool)
        self.n += 1
        if not live or self.rng.random() < 0.3:
            rid = f"{self.name_prefix}-{self.n}"
            prompt = [self.rng.randrange(4)] * 16 + [self.rng.randrange(3000) for _ in range(self.rng.randint(1, 40))]
            r = self.client.step(pool, [AddRequestOp(rid, token_ids=prompt),
                                        AllocateOp(rid, num_new_tokens=len(prompt))])
            assert r[0].status == OpStatus.OK, r[0]  # never ALREADY_EXISTS: a resent step applied once
            if r[1].status == OpStatus.OK:
                self.tokens[(pool, rid)] = len(prompt)
            else:
                self.client.step(pool, [FreeOp(rid)])
        elif self.rng.random() < 0.8:
            rids = self.rng.sample(live, min(len(live), 4))
            r = self.client.step(pool, [DecodeBatchOp(rids, [self.tokens[(pool, x)] for x in rids], [5] * len(rids))])
            for i, rid in enumerate(rids):
                if r[0].batch.status(i) == OpStatus.OK:
                    self.tokens[(pool, rid)] += 1
                else:
                    self.client.step(pool, [FreeOp(rid)])
                    del self.tokens[(pool, rid)]
        else:
            rid = self.rng.choice(live)
            assert self.client.step(pool, [FreeOp(rid)])[0].status == OpStatus.OK
            del self.tokens[(pool, rid)]
        self.steps[pool] += 1

    def check(self) -> list[str]:
        lost = []
        for (pool, rid), n in self.tokens.items():
            info = self.client.get_request(pool, rid)
            if info.num_tokens != n:
                lost.append(f"{pool}/{rid}: {info.num_tokens} tokens, {n} acknowledged")
        return lost


def register(client: KVServiceClient, pools: list[str]) -> dict[str, str]:
    for pool in pools:
        client.register_pool(pool, CONFIG, max_model_len=1024, kv_layout="block=16")
    return dict(client.shard_map().pools)


def invariants(client: KVServiceClient) -> dict[str, str]:
    return {p: s.invariant_violation for p, s in client.get_stats(check_invariants=True).pools.items()
            if s.invariant_violation}


def test_pools_spread_over_the_shards_and_random_load_keeps_invariants(deployment):
    c = deployment.client()
    pools = [f"spread-{i}" for i in range(6)]
    where = register(c, pools)
    assert sorted({where[p] for p in pools}) == list(SHARDS)  # least-loaded placement used every shard
    workers = [Worker(deployment.client(), pools, seed) for seed in range(2)]
    for w in workers:
        w.start()
    time.sleep(4)
    for w in workers:
        w.stop_now.set()
        w.join(30)
        assert w.error is None, w.error
        assert not w.check()
    assert invariants(c) == {}
    stats = c.get_stats()
    assert set(pools) <= set(stats.pools) and stats.num_sessions >= 3 * 3  # one session attached per shard
    c.close()


def test_a_killed_shard_leader_fails_over_and_the_others_never_stall(deployment):
    c = deployment.client()
    pools = [f"fail-{i}" for i in range(6)]
    where = register(c, pools)
    victim = where[pools[0]]
    # One engine on the victim shard's pools, one on the others' (an engine blocked on its pool must not
    # be what holds the others back).
    worker = Worker(deployment.client(), [p for p in pools if where[p] == victim], seed=7)
    bystander = Worker(deployment.client(), [p for p in pools if where[p] != victim], seed=8)
    worker.start()
    bystander.start()
    time.sleep(2)
    others_before = sum(bystander.steps.values())
    old = deployment.leaders[victim]
    old.proc.send_signal(signal.SIGKILL)
    old.proc.wait(10)
    killed_at = time.monotonic()
    # The victim's pools wait for its standby; the other shards' pools go on meanwhile.
    while time.monotonic() - killed_at < 1.5:
        time.sleep(0.1)
    others_during = sum(bystander.steps.values()) - others_before
    time.sleep(4)
    for w in (worker, bystander):
        w.stop_now.set()
        w.join(60)
        assert w.error is None, w.error
    assert others_during > 0, "steps on the other shards stalled while one shard failed over"
    assert not worker.check() and not bystander.check(), "an acknowledged step was lost in the failover"
    assert sum(worker.steps.values()) > 0
    new_map = c.shard_map()
    new_leader = next(s for s in new_map.shards if s.shard_id == victim)
    assert new_leader.address == deployment.standbys[victim].target and new_leader.epoch >= 2
    deployment.leaders[victim] = deployment.standbys[victim]  # the standby leads now; give it a new standby
    deployment.standbys[victim] = deployment.start(victim, "--standby")
    assert invariants(c) == {}
    c.close()


def test_a_zombie_leader_is_fenced(deployment):
    """A leader frozen (SIGSTOP) past its lease: its standby takes over; woken, the old one exits 3."""
    shard = "s2"
    zombie = deployment.leaders[shard]
    zombie.proc.send_signal(signal.SIGSTOP)
    c = deployment.client()
    pool = "zombie-pool"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the standby takes over once the lease lapsed
            info = next(s for s in c.shard_map().shards if s.shard_id == shard)
            if info.address == deployment.standbys[shard].target:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the standby did not take over from a frozen leader")
    finally:
        zombie.proc.send_signal(signal.SIGCONT)
    assert zombie.proc.wait(30) == 3  # fenced: it exits rather than serve from memory
    deployment.leaders[shard] = deployment.standbys[shard]
    deployment.standbys[shard] = deployment.start(shard, "--standby")
    register(c, [pool])
    c.step(pool, [AddRequestOp("z", token_ids=[1, 2, 3]), AllocateOp("z", num_new_tokens=3), FreeOp("z")])
    c.close()


def test_rebalance_under_load_moves_pools_without_losing_a_block(deployment):
    c = deployment.client()
    pools = [f"move-{i}" for i in range(3)]
    register(c, pools)
    worker = Worker(deployment.client(), pools, seed=11)
    worker.start()
    time.sleep(1)
    before = dict(c.shard_map().pools)
    target = next(s for s in SHARDS if s != before[pools[0]])
    moved = subprocess.run([sys.executable, "-m", "kvservice.cli", "shards", "move", "--target",
                            deployment.leaders["s0"].target, "--pool", pools[0], "--to", target],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert moved.returncode == 0 and f"moved {pools[0]}: {before[pools[0]]} -> {target}" in moved.stdout, \
        moved.stdout + moved.stderr
    time.sleep(1.5)
    worker.stop_now.set()
    worker.join(60)
    assert worker.error is None, worker.error
    assert dict(c.shard_map().pools)[pools[0]] == target
    assert not worker.check() and worker.steps[pools[0]] > 0
    assert invariants(c) == {}
    plan = subprocess.run([sys.executable, "-m", "kvservice.cli", "shards", "rebalance", "--dry-run", "--target",
                           deployment.leaders["s1"].target], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert plan.returncode == 0, plan.stderr
    c.close()


@pytest.mark.parametrize("killed", ["source", "destination"])
def test_a_cross_shard_transfer_survives_either_side_killed(deployment, killed):
    c = deployment.client()
    pools = [f"xs-{killed}-a", f"xs-{killed}-b"]
    where = register(c, pools)
    src, dst = pools
    if where[src] == where[dst]:  # place them on two shards
        target = next(s for s in SHARDS if s != where[src])
        from kvservice.shards.rebalance import Rebalancer
        Rebalancer(c).move(dst, where[dst], target, {s.shard_id: s.address for s in c.shard_map().shards})
        where = dict(c.shard_map().pools)
    prompt = list(range(100, 200))
    c.step(src, [AddRequestOp("p", token_ids=prompt), AllocateOp("p", num_new_tokens=100), FreeOp("p")])
    pin = c.step(src, [PinOp("pin", token_ids=prompt + [1])])[0]
    assert pin.num_computed_tokens == 96
    victim_shard = where[src] if killed == "source" else where[dst]
    if killed == "source":  # between the pin and the admission
        kill_leader(deployment, victim_shard)
    r = c.step(dst, [AddRequestOp("x", token_ids=prompt + [1]),
                     AllocateOp("x", num_new_tokens=101, allow_transfer=True,
                                external_source=ExternalSource("pin", src, pin.new_block_ids[0], 96))])
    order = r[1].transfer
    assert order is not None and order.src_block_ids == pin.new_block_ids[0]
    if killed == "destination":  # between the order and the commit
        kill_leader(deployment, victim_shard)
    assert c.commit_transfer(dst, order.transfer_id)[0].status == OpStatus.OK
    assert c.step(src, [UnpinOp("pin")])[0].status == OpStatus.OK  # the pin outlived its shard's failover
    assert c.lookup(prompt + [1], pool_ids=[dst]).tokens(dst) == 96
    stats = c.get_stats(check_invariants=True)
    assert stats.pools[src].num_free_blocks == 128 and not stats.pools[src].invariant_violation
    c.free(dst, "x")
    c.close()


def kill_leader(deployment: Deployment, shard: str) -> None:
    proc = deployment.leaders[shard]
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    deployment.leaders[shard] = deployment.standbys[shard]
    deployment.standbys[shard] = deployment.start(shard, "--standby")


def test_unsharded_clients_see_one_unnamed_shard(tmp_path):
    import grpc

    from kvservice._proto import allocator_pb2 as pb
    from tests.service_helpers import start_server
    proc = start_server(log_dir=tmp_path)
    try:
        with proc.client() as c:
            c.register_pool("solo", CONFIG, max_model_len=1024)
            m = c.shard_map()
            assert not m.sharded and dict(m.pools) == {"solo": ""}
            with pytest.raises(grpc.RpcError) as info:
                c.stub.MovePool(pb.MovePoolRequest(pool_id="solo"), timeout=5)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "sharded allocators" in info.value.details()
    finally:
        proc.stop()


def test_a_single_shard_fails_over_to_the_standby_named_in_the_target(tmp_path):
    """One shard and its standby: when the only known shard dies, no shard is left to ask for the map, so the
    client asks the target's other address (the standby), which then leads; the next Step succeeds there."""
    from tests.redis_helpers import RedisServer
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    start = lambda *a: start_shard(redis.url, "s0", tmp_path, "--leader-lease", "0.5", *a, namespace="solo")  # noqa: E731
    leader, standby = start(), start("--standby")
    try:
        with KVServiceClient(f"{leader.target},{standby.target}", failover_timeout_s=30) as c:
            c.register_pool("p", CONFIG, max_model_len=1024)
            c.step("p", [AddRequestOp("r", token_ids=list(range(40))), AllocateOp("r", num_new_tokens=40)])
            leader.proc.send_signal(signal.SIGKILL)
            leader.proc.wait(10)
            r = c.step("p", [DecodeBatchOp(["r"], [40], [7])])
            assert r.results[0].batch.statuses == bytes(1)
            assert c.shard_map().shards[0].address == standby.target
            assert c.get_request("p", "r").num_tokens == 41  # nothing acknowledged lost
    finally:
        for p in (leader, standby):
            p.stop()
        redis.stop()
