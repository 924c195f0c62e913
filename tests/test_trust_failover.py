"""Failover and partial failure as a hostile operator drives them (issue 22, items 4-7), on real processes:
`kvservice serve` children on loopback and a real Redis (Debian's redis-server 7 where installed).

- a failover chain leader -> standby -> the old leader restarted on its port: an existing client (sync and
  asyncio, sharded and not) follows the lead back to its own seed, and its session outlives it;
- a fan-out Lookup with one shard killed (or frozen) answers from the live ones, naming the missing shard;
- `kvservice status` over two shards with one down shows the live one's pools and the other as down;
- sharded GetStats keeps external pools, and RemoveExternalPool reaches the shard that holds the pool.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from kvservice.client import AsyncKVServiceClient, KVServiceClient
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.errors import Code, KVServiceError
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp
from tests.cluster_helpers import start_shard
from tests.redis_helpers import RedisServer, debian_redis
from tests.service_helpers import REPO, start_server

CONFIG = KVCacheConfig(129, [FullAttentionSpec(16)])
TTL = "3"  # a session lease short enough that a client whose lease renewal lost the leader would lose it


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path / "redis", executable=debian_redis())
    server.start()
    yield server
    server.stop()


def start_allocator(redis: RedisServer, tmp_path, sharded: bool, *args: str, port: int = 0):
    common = ("--leader-lease", "0.5", "--session-ttl", TTL, *args)
    if sharded:
        return start_shard(redis.url, "s0", tmp_path, *common, port=port, namespace="chain")
    return start_server("--redis-url", redis.url, "--redis-namespace", "chain", *common, port=port,
                        persistence=True, log_dir=tmp_path)


def wait_exit(proc, timeout_s: float = 30.0) -> int:
    try:
        return proc.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.target} did not exit within {timeout_s} s")


def kill9(proc) -> None:
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)


def prompt(n: int) -> list[int]:
    return [(i * 7 + n) % 1000 for i in range(40)]


# ---- item 4: the lead back to a seed -------------------------------------------------------------------
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "unsharded"])
def test_a_client_follows_a_failover_chain_back_to_its_seed(redis, tmp_path, sharded):
    """Leader L and standby S; kill -9 L (S leads); L's command again on its port (it leads, S exits 3).
    The client, idle meanwhile for several leases, reaches L at its seed address and lost nothing."""
    leader = start_allocator(redis, tmp_path, sharded)
    standby = start_allocator(redis, tmp_path, sharded, "--standby")
    restarted = None
    try:
        with KVServiceClient(f"{leader.target},{standby.target}", failover_timeout_s=30) as c:
            c.register_pool("p", CONFIG, max_model_len=1024)
            c.step("p", [AddRequestOp("r1", token_ids=prompt(1)), AllocateOp("r1", num_new_tokens=40)])
            kill9(leader)
            c.step("p", [AddRequestOp("r2", token_ids=prompt(2)), AllocateOp("r2", num_new_tokens=40)])  # S's
            restarted = start_allocator(redis, tmp_path, sharded, port=leader.port)
            assert wait_exit(standby) == 3, "the standby that led was not fenced by the restarted leader"
            time.sleep(3 * float(TTL))  # idle: only the client's lease renewal speaks to the allocator
            r = c.step("p", [DecodeBatchOp(["r1", "r2"], [40, 40], [5, 6])])
            assert r.results[0].batch.statuses == bytes(2)
            assert c.get_request("p", "r1").num_tokens == 41  # nothing acknowledged lost, the lease kept
            assert c.get_request("p", "r2").num_tokens == 41  # what the standby acknowledged too
            if sharded:
                assert c.shard_map().shards[0].address == restarted.target
    finally:
        for p in (leader, standby, restarted):
            if p is not None:
                p.stop()


@pytest.mark.slow  # make test-slow (make test stays under 15 minutes)
def test_an_asyncio_client_follows_a_failover_chain_back_to_its_seed(redis, tmp_path):
    leader = start_allocator(redis, tmp_path, True)
    standby = start_allocator(redis, tmp_path, True, "--standby")
    procs = [leader, standby]

    async def scenario() -> None:
        async with AsyncKVServiceClient(f"{leader.target},{standby.target}", failover_timeout_s=30) as c:
            await c.register_pool("p", CONFIG, max_model_len=1024)
            await c.step("p", [AddRequestOp("r1", token_ids=prompt(1)), AllocateOp("r1", num_new_tokens=40)])
            kill9(leader)
            await c.step("p", [AddRequestOp("r2", token_ids=prompt(2)), AllocateOp("r2", num_new_tokens=40)])
            # (in a thread: the client's lease renewal runs on this loop meanwhile)
            procs.append(await asyncio.to_thread(start_allocator, redis, tmp_path, True, port=leader.port))
            assert await asyncio.to_thread(wait_exit, standby) == 3
            await asyncio.sleep(3 * float(TTL))
            r = await c.step("p", [DecodeBatchOp(["r1", "r2"], [40, 40], [5, 6])])
            assert r.results[0].batch.statuses == bytes(2)
            assert (await c.get_request("p", "r2")).num_tokens == 41

    try:
        asyncio.run(scenario())
    finally:
        for p in procs:
            p.stop()


# ---- items 5-7: two shards, no standby ------------------------------------------------------------------
@pytest.fixture
def two_shards(redis, tmp_path):
    shards = {s: start_shard(redis.url, s, tmp_path, "--leader-lease", "0.5", namespace="pair") for s in ("s0", "s1")}
    yield shards
    for proc in shards.values():
        if proc.proc.poll() is None:
            with_continue(proc)
            proc.stop()


def with_continue(proc) -> None:
    proc.proc.send_signal(signal.SIGCONT)  # a frozen one must be able to stop


def pools_on_both(c: KVServiceClient) -> dict[str, str]:
    """Registers pools until each shard has one; returns pool -> shard, one request cached in each."""
    for i in range(8):
        c.register_pool(f"p{i}", CONFIG, max_model_len=1024)
        owners = dict(c.shard_map().pools)
        if set(owners.values()) == {"s0", "s1"}:
            break
    for pool_id in owners:
        c.step(pool_id, [AddRequestOp("r", token_ids=prompt(0)), AllocateOp("r", num_new_tokens=40)])
        c.free(pool_id, "r")
    return owners


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_lookup_answers_from_the_live_shards_and_names_the_missing_one(two_shards, fault):
    shards = two_shards
    with KVServiceClient(",".join(p.target for p in shards.values()), failover_timeout_s=30) as c:
        owners = pools_on_both(c)
        full = c.lookup(prompt(0))
        assert {h.pool_id for h in full.hits} == set(owners) and full.missing_shards == []
        victim = shards["s1"]
        if fault == "kill":
            kill9(victim)
        else:
            victim.proc.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        part = c.lookup(prompt(0))
        waited = time.monotonic() - start
        live = {p for p, s in owners.items() if s == "s0"}
        assert {h.pool_id for h in part.hits} == live and part.best_pool_id in live
        assert all(h.num_cached_tokens == 32 for h in part.hits)
        assert part.missing_shards == ["s1"]
        assert c.unanswered_lookups["s1"] == 1
        assert waited < c.timeout_s  # bounded (the grace past s0's answer), not a failover timeout


def test_an_asyncio_lookup_answers_from_the_live_shards(two_shards):
    shards = two_shards
    with KVServiceClient(",".join(p.target for p in shards.values())) as c:
        owners = pools_on_both(c)
    shards["s1"].proc.send_signal(signal.SIGSTOP)

    async def scenario():
        async with AsyncKVServiceClient(",".join(p.target for p in shards.values())) as c:
            return await c.lookup(prompt(0)), c.unanswered_lookups["s1"]

    part, counted = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert {h.pool_id for h in part.hits} == {p for p, s in owners.items() if s == "s0"}
    assert part.missing_shards == ["s1"] and counted == 1


def run_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvservice.cli", "--log-level", "WARNING", "status", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_status_shows_the_live_shards_pools_and_the_dead_one_as_down(two_shards):
    shards = two_shards
    target = ",".join(p.target for p in shards.values())
    with KVServiceClient(target) as c:
        owners = pools_on_both(c)
    healthy = run_status("--target", target)
    assert healthy.returncode == 0, healthy.stderr
    kill9(shards["s1"])
    out = run_status("--target", target)
    assert out.returncode == 3, (out.returncode, out.stdout, out.stderr)  # degraded, not failed
    for pool_id, shard in owners.items():
        assert (pool_id in out.stdout) == (shard == "s0"), out.stdout
    down = [line for line in (out.stdout + out.stderr).splitlines() if "s1" in line and "down" in line]
    assert down and shards["s1"].target in down[0], out.stdout + out.stderr
    kill9(shards["s0"])
    assert run_status("--target", target).returncode == 1  # nothing answered


def test_sharded_stats_and_removal_reach_the_shard_of_an_external_pool(two_shards):
    shards = two_shards
    with KVServiceClient(shards["s1"].target) as on_s1:  # s1 subscribes (an external pool is not in the map)
        on_s1.register_external_pool("ext", "tcp://127.0.0.1:1", block_size=16)
    with KVServiceClient(f"{shards['s0'].target},{shards['s1'].target}") as c:
        assert "ext" in c.shard_stats()["s1"].external_pools
        assert "ext" in c.get_stats().external_pools
        assert any(h.pool_id == "ext" for h in c.lookup(prompt(0), pool_ids=["ext"]).hits)
        c.register_external_pool("ext", "tcp://127.0.0.1:1", block_size=16)  # idempotent, on its own shard
        assert "ext" not in c.shard_stats()["s0"].external_pools
        c.remove_external_pool("ext")
        assert "ext" not in c.get_stats().external_pools
        with pytest.raises(KVServiceError) as info:
            c.remove_external_pool("ext")
        assert info.value.code is Code.NOT_FOUND


def test_sharded_asyncio_stats_and_removal_reach_the_shard_of_an_external_pool(two_shards):
    shards = two_shards
    with KVServiceClient(shards["s1"].target) as on_s1:
        on_s1.register_external_pool("ext", "tcp://127.0.0.1:1", block_size=16)

    async def scenario() -> None:
        async with AsyncKVServiceClient(f"{shards['s0'].target},{shards['s1'].target}") as c:
            assert "ext" in (await c.get_stats()).external_pools
            await c.remove_external_pool("ext")
            assert "ext" not in (await c.shard_stats())["s1"].external_pools

    asyncio.run(scenario())
