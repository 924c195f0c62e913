"""`kvservice deploy --allocator-shards 2 --standbys` on a two-node Ray cluster on this machine
(ray.cluster_utils): shards and their standbys as detached actors spread over the nodes, pools spread over
the shards, the router and engines finding each pool's shard from the map; a shard's actor killed: its
standby takes over and Ray brings the actor back (as a standby)."""

import random
import time

import pytest

from tests.redis_helpers import RedisServer
from tests.test_deploy import MODEL, assert_dense
from worker import deploy

ray = pytest.importorskip("ray")
from worker.ray_local import joined_cluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    with joined_cluster({"num_cpus": 1}, {"num_cpus": 1}, namespace=deploy.NAMESPACE) as c:
        yield c


@pytest.fixture(scope="module")
def up(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shards")
    redis = RedisServer(tmp / "redis")
    redis.start()
    cfg = deploy.DeployConfig(pools=2, num_blocks=32, block_size=16, max_model_len=256, max_num_batched_tokens=128,
                              max_num_seqs=8, backend="torch", rank_cpus=0.25, host="127.0.0.1", port=0,
                              data_dir=str(tmp / "data"), redis_url=redis.url, allocator_shards=2, standbys=True)
    try:
        yield deploy.deploy(cfg)
    finally:
        deploy.teardown()
        redis.stop()


def node_of(name: str) -> str:
    return ray.get(ray.get_actor(name, namespace=deploy.NAMESPACE).where.remote())


def test_shards_spread_over_nodes_and_pools_over_shards(up):
    names = {s: deploy.shard_actor_name(s) for s in ("s0", "s1")}
    assert node_of(names["s0"]) != node_of(names["s1"])
    assert node_of(deploy.shard_actor_name("s0", standby=True)) != node_of(names["s0"])
    from kvservice.client import KVServiceClient
    with KVServiceClient(up.target) as c:
        m = c.shard_map()
    assert m.sharded and sorted(s.shard_id for s in m.shards) == ["s0", "s1"]
    assert sorted(m.pools.values()) == ["s0", "s1"]  # one pool on each shard


def test_router_and_engines_follow_the_map_and_a_dead_shard_fails_over(up):
    rng = random.Random(3)
    prompts = [[rng.randrange(MODEL.vocab_size) for _ in range(40)] for _ in range(4)]
    router = up.router(replica=True)  # routes from a replica of the index (PrefixIndex)
    assert router.index.wait_synced()
    outputs = router.generate(prompts, max_tokens=4)
    assert_dense(prompts, outputs, 4)
    deadline = time.monotonic() + 10
    while router.route(prompts[0]).cached_tokens == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the engines' cached blocks reach the replica as events
    asked = router.index.remote_lookups
    assert router.route(prompts[0]).cached_tokens == 32 and router.index.remote_lookups == asked
    victim = ray.get_actor(deploy.shard_actor_name("s0"), namespace=deploy.NAMESPACE)
    resyncs = router.index.resyncs("s0")
    ray.kill(victim, no_restart=False)  # its server dies with it; Ray restarts the actor
    deadline = time.monotonic() + 120
    while router.index.resyncs("s0") == resyncs and time.monotonic() < deadline:
        time.sleep(0.05)  # the replica saw s0's stream end: s0's leader is gone
    # Routed from the replica's hashes as they were (no RPC to a shard that is failing over), then run by the
    # engines, whose steps wait for s0's standby to take over.
    again = router.generate(prompts[:2], max_tokens=4)
    assert again == outputs[:2]
    assert sum(router.routed_by_prefix.values()) >= 2  # the repeated prompts went where they were cached
    from kvservice.client import KVServiceClient
    with KVServiceClient(up.target) as c:
        s0 = next(s for s in c.shard_map().shards if s.shard_id == "s0")
    assert s0.epoch >= 2
    # Ray brings the killed actor back: as a standby, or as the leader when it was back (Ray restarted it in 1.9 s
    # on an idle machine) before the standby's lease wait ended and it won the election itself.
    deadline = time.monotonic() + 300  # (a bound on a loaded machine: the loop ends once it is back)
    health = None
    while time.monotonic() < deadline:
        try:
            health = ray.get(victim.health.remote(), timeout=10)
            if health in ("NOT_SERVING", "SERVING"):
                break
        except Exception:  # noqa: BLE001 - still restarting
            pass
        time.sleep(1)
    else:
        pytest.fail(f"Ray did not restart the killed shard actor (its health: {health!r})")
