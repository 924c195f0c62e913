"""PrefixIndex, a router's replica of the prefix index built from WatchEvents(include_state), against the
Lookup RPC of real servers: a random workload with evictions, resets and a pool the replica cannot answer
for (asked over RPC); a replica started late (the dump); tenants; and on sharded allocators (a Redis
Cluster) a leader killed and a pool moved under the replica."""

from __future__ import annotations

import random
import signal
import time

import pytest

from kvservice.client import KVServiceClient, PrefixIndex
from kvservice.core import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from kvservice.errors import InvalidArgument
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp, FreeOp, OpStatus
from tests.cluster_helpers import RedisCluster, cluster_available, start_shard
from tests.service_helpers import start_server

BS = 16


class Workload:
    """Random admissions (prompts from a few families), decodes, frees and resets over some pools."""

    def __init__(self, client: KVServiceClient, pools: list[str], seed: int) -> None:
        self.client, self.pools, self.rng = client, pools, random.Random(seed)
        self.families = [[self.rng.randrange(1000) for _ in range(4 * BS)] for _ in range(4)]
        self.running: dict[str, dict[str, int]] = {p: {} for p in pools}
        self.n = 0

    def prompt(self) -> list[int]:
        return self.rng.choice(self.families)[:self.rng.randrange(BS, 4 * BS + 1)] + \
            [self.rng.randrange(1000) for _ in range(self.rng.randrange(0, 2 * BS))]

    def one(self) -> None:
        pool = self.rng.choice(self.pools)
        running = self.running[pool]
        roll = self.rng.random()
        if roll < 0.45 or not running:
            rid, prompt = f"r{self.n}", self.prompt()
            self.n += 1
            r = self.client.step(pool, [AddRequestOp(rid, token_ids=prompt),
                                        AllocateOp(rid, num_new_tokens=len(prompt))])
            if r[1].status == OpStatus.OK:
                running[rid] = len(prompt)
            else:
                self.client.free(pool, rid)
        elif roll < 0.75:
            ids = list(running)
            r = self.client.step(pool, [DecodeBatchOp(ids, [running[i] for i in ids],
                                                      [self.rng.randrange(1000) for _ in ids])])
            for rid, status in zip(ids, r[0].batch.statuses):
                if status == 0:
                    running[rid] += 1
        elif roll < 0.97:
            rid = self.rng.choice(list(running))
            self.client.step(pool, [FreeOp(rid)])
            del running[rid]
        else:
            if running:
                self.client.step(pool, [FreeOp(rid) for rid in running])
                running.clear()
            self.client.reset_prefix_cache([pool])


def caught_up(client: KVServiceClient, index: PrefixIndex, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        newest = {s: st.event_sequence for s, st in client.shard_stats().items()}
        if index.synced() and all(index.applied_sequence(s) >= n for s, n in newest.items()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replica did not catch up: {newest} vs "
                               f"{ {s: index.applied_sequence(s) for s in newest} }")
        time.sleep(0.01)


def assert_same_answers(client: KVServiceClient, index: PrefixIndex, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        theirs = {h.pool_id: (h.num_cached_tokens, h.num_cached_blocks) for h in client.lookup(prompt).hits}
        mine = {h.pool_id: (h.num_cached_tokens, h.num_cached_blocks) for h in index.lookup(prompt).hits}
        assert mine == theirs, (len(prompt), mine, theirs)


@pytest.fixture()
def server(tmp_path):
    proc = start_server("--token-file", str(_tokens(tmp_path)), log_dir=tmp_path)
    yield proc
    proc.stop()


def _tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("tok-a tenant-a\ntok-b tenant-b\ntok-admin ops admin\n")
    return path


def test_the_replica_answers_as_lookup_through_evictions_and_resets(server):
    with KVServiceClient(server.target, "tok-admin") as client:  # an admin: ResetPrefixCache
        client.register_pool("small", KVCacheConfig(24, [FullAttentionSpec(BS)]), max_model_len=512)
        client.register_pool("big", KVCacheConfig(200, [FullAttentionSpec(BS)]), max_model_len=512)
        client.register_pool("windowed", KVCacheConfig(64, [SlidingWindowSpec(BS, 32)]), max_model_len=512)
        work = Workload(client, ["small", "big", "windowed"], seed=1)
        for _ in range(40):  # blocks cached before the replica starts: they reach it through the dump
            work.one()
        with PrefixIndex(client, refresh_s=0.2) as index:
            assert index.wait_synced()
            stats = client.get_stats().pools
            assert stats["small"].plain_prefix and not stats["windowed"].plain_prefix
            assert index.num_blocks() > 0
            for _ in range(150):
                work.one()
                caught_up(client, index)
                assert_same_answers(client, index, [work.prompt() for _ in range(3)])
            # Plain pools are answered from memory: no Lookup reaches the server for them.
            asked = index.remote_lookups
            index.lookup(work.prompt(), pool_ids=["small", "big"])
            assert index.remote_lookups == asked
            index.lookup(work.prompt(), pool_ids=["windowed"])
            assert index.remote_lookups == asked + 1


def test_a_tenant_replica_holds_only_its_own_pools(server):
    with KVServiceClient(server.target, "tok-a") as a, KVServiceClient(server.target, "tok-b") as b:
        a.register_pool("a-pool", KVCacheConfig(64, [FullAttentionSpec(BS)]), max_model_len=512)
        b.register_pool("b-pool", KVCacheConfig(64, [FullAttentionSpec(BS)]), max_model_len=512)
        secret = list(range(500, 564))
        b.step("b-pool", [AddRequestOp("s", token_ids=secret), AllocateOp("s", num_new_tokens=64), FreeOp("s")])
        with PrefixIndex(a, refresh_s=0.2) as index:
            assert index.wait_synced()
            a.step("a-pool", [AddRequestOp("x", token_ids=secret[:32]), AllocateOp("x", num_new_tokens=32)])
            b.step("b-pool", [AddRequestOp("t", token_ids=secret + [1]), AllocateOp("t", num_new_tokens=65)])
            caught_up(a, index)
            hits = index.lookup(secret + [7]).hits
            assert [(h.pool_id, h.num_cached_tokens) for h in hits] == [("a-pool", 32)]
            assert index.num_blocks() == 2  # b's blocks never reached a's replica


def test_include_state_with_a_start_sequence_is_refused(server):
    with KVServiceClient(server.target, "tok-a") as client:
        with pytest.raises(InvalidArgument, match="start_sequence"):
            next(iter(client.watch_events(start_sequence=1, include_state=True, timeout_s=5)))


@pytest.mark.skipif(not cluster_available(), reason="needs Debian's redis-server and redis-cli (make install)")
def test_the_replica_follows_a_failover_and_a_moved_pool(tmp_path):
    cluster = RedisCluster(tmp_path / "redis").start()
    start = lambda shard, *a: start_shard(cluster.url, shard, tmp_path, "--leader-lease", "0.5", *a,  # noqa: E731
                                          namespace="idx")
    leaders = {s: start(s) for s in ("s0", "s1")}
    standbys = {s: start(s, "--standby") for s in ("s0", "s1")}
    seeds = ",".join(p.target for p in [*leaders.values(), *standbys.values()])
    try:
        with KVServiceClient(seeds, failover_timeout_s=30) as client:
            pools = [f"p{i}" for i in range(4)]
            for p in pools:
                client.register_pool(p, KVCacheConfig(32, [FullAttentionSpec(BS)]), max_model_len=512)
            work = Workload(client, pools, seed=2)
            with PrefixIndex(client, refresh_s=0.2) as index:
                assert index.wait_synced()
                for _ in range(30):
                    work.one()
                caught_up(client, index)
                assert_same_answers(client, index, [work.prompt() for _ in range(5)])

                where = dict(client.shard_map().pools)
                leaders["s0"].proc.send_signal(signal.SIGKILL)
                leaders["s0"].proc.wait(10)
                for _ in range(20):  # steps on s0's pools wait for its standby; the replica resyncs
                    work.one()
                caught_up(client, index)
                assert index.resyncs("s0") >= 1
                assert_same_answers(client, index, [work.prompt() for _ in range(5)])

                from kvservice.shards.rebalance import Rebalancer
                moving = next(p for p in pools if where[p] == "s1")
                addresses = {s.shard_id: s.address for s in client.shard_map().shards}
                Rebalancer(client).move(moving, "s1", "s0", addresses)
                for _ in range(20):
                    work.one()
                deadline = time.monotonic() + 10
                while dict(client.shard_map().pools)[moving] != "s0" and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)  # a refresh sees the move and resyncs s0
                caught_up(client, index)
                assert_same_answers(client, index, [work.prompt() for _ in range(5)])
    finally:
        for p in [*leaders.values(), *standbys.values()]:
            p.stop()
        cluster.stop()


def test_a_broken_stream_answers_from_the_hashes_as_they_were(tmp_path):
    """The allocator dies (its standby, if any, not yet leading): the replica answers its pools from the hashes it
    had, the same answers as before the death and without a Lookup RPC, which would wait out a failover (as long
    as a loaded machine makes it) and then fail. Before: that RPC, and "Connection refused" once it gave up."""
    proc = start_server(log_dir=tmp_path)
    with KVServiceClient(proc.target, failover_timeout_s=1, retries=0) as client:
        pools = ["p0", "p1"]
        for p in pools:
            client.register_pool(p, KVCacheConfig(32, [FullAttentionSpec(BS)]), max_model_len=512)
        work = Workload(client, pools, seed=5)
        with PrefixIndex(client, refresh_s=0.2) as index:
            assert index.wait_synced()
            for _ in range(30):
                work.one()
            caught_up(client, index)
            prompts = [work.prompt() for _ in range(8)]
            assert_same_answers(client, index, prompts)
            before = [index.lookup(p).hits for p in prompts]
            resyncs = index.resyncs()
            proc.proc.send_signal(signal.SIGKILL)
            proc.proc.wait(10)
            deadline = time.monotonic() + 30
            while index.resyncs() == resyncs and time.monotonic() < deadline:
                time.sleep(0.01)  # the replica saw the stream end
            asked = index.remote_lookups
            assert [index.lookup(p).hits for p in prompts] == before
            assert index.remote_lookups == asked and any(h.num_cached_tokens for hits in before for h in hits)


def test_a_dump_carries_a_sha256_pools_whole_hashes(server):
    """A pool with vLLM's sha256 chain (32-byte hashes): WatchEvents(include_state)'s dump names its blocks
    exactly as its live `stored` events did, and the replica leaves the pool to Lookup RPCs (its clients'
    chain is not the one the replica hashes prompts with)."""
    from kvservice.hashing import HashSpec
    with KVServiceClient(server.target, "tok-a") as a:
        a.register_pool("sha-pool", KVCacheConfig(64, [FullAttentionSpec(BS)]), max_model_len=512,
                        hash_spec=HashSpec("sha256"))
        live = a.open_events(["sha-pool"], timeout_s=10)
        prompt = list(range(900, 948))
        a.step("sha-pool", [AddRequestOp("s", token_ids=prompt), AllocateOp("s", num_new_tokens=48)])
        stored = []
        for event in live:
            stored += event.block_hashes if event.kind == "stored" else []
            if len(stored) >= 3:
                break
        live.cancel()
        assert len(stored) == 3 and all(len(h) == 32 for h in stored)
        dump = []
        for event in a.watch_events(["sha-pool"], include_state=True, timeout_s=5):
            if event.kind == "synced":
                break
            dump += event.block_hashes if event.kind == "stored" else []
        assert sorted(dump) == sorted(stored)
        assert not a.get_stats().pools["sha-pool"].plain_prefix
        with PrefixIndex(a, refresh_s=0.2) as index:
            assert index.wait_synced()
            asked = index.remote_lookups
            index.lookup(prompt, pool_ids=["sha-pool"])
            assert index.remote_lookups == asked + 1
