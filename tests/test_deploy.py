"""`kvservice deploy` on a two-node Ray cluster on this machine (ray.cluster_utils.Cluster): the allocator actor
on the head node, one pool per node, KV-aware routing, outputs equal to the dense model, scale-out, teardown."""

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis as redis_py

from worker import deploy
from worker.model import ModelConfig, TinyTransformer
from worker.request import EngineRequest
from worker.sampling import SamplingParams
from worker.verify import verify

ray = pytest.importorskip("ray")
from worker.ray_local import joined_cluster  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = ModelConfig()


@pytest.fixture(scope="module")
def cluster():
    head, second = {"num_cpus": 1, "resources": {"head_node": 1}}, {"num_cpus": 1, "resources": {"second_node": 1}}
    with joined_cluster(head, second, namespace=deploy.NAMESPACE) as c:
        yield c


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """The allocator on loopback (tests never listen beyond it), with auth on: the engines and the router get
    the token from the allocator actor (as they get a generated one on a real cluster)."""
    data = tmp_path_factory.mktemp("allocator")
    (data / "tokens").write_text("deploy-token ops admin\n")
    return deploy.DeployConfig(pools=2, num_blocks=32, block_size=16, max_model_len=256, max_num_batched_tokens=128,
                               max_num_seqs=8, backend="torch", rank_cpus=0.25, host="127.0.0.1", port=0,
                               data_dir=str(data), token_file=str(data / "tokens"))


@pytest.fixture(scope="module")
def up(cluster, config):
    try:
        yield deploy.deploy(config)
    finally:
        deploy.teardown()


def node_of(name: str) -> str:
    return ray.get(ray.get_actor(name, namespace=deploy.NAMESPACE).where.remote())


def assert_dense(prompts: list[list[int]], outputs: list[list[int]], max_tokens: int) -> None:
    """Greedy outputs equal the dense reference model's (no cache)."""
    assert [len(o) for o in outputs] == [max_tokens] * len(prompts)
    seqs = [EngineRequest(f"r{i}", p + o, len(p), SamplingParams(max_tokens=max_tokens), 0)
            for i, (p, o) in enumerate(zip(prompts, outputs))]
    result = verify(TinyTransformer(MODEL), seqs)
    assert result.ok, result.mismatches


def test_allocator_on_the_head_and_one_pool_per_node(cluster, up):
    head = cluster.head_node.node_id
    assert ray.get(up.allocator.health.remote()) == "SERVING"
    assert ray.get(up.allocator.where.remote()) == head
    assert list(up.engines) == ["p0", "p1"] and up.created == ["p0", "p1"]
    nodes = [node_of(deploy.rank_name(p, 0)) for p in up.engines]
    assert len(set(nodes)) == 2  # pools spread over both nodes
    assert [node_of(deploy.engine_name(p)) for p in up.engines] == nodes  # engines beside their ranks


def test_router_is_kv_aware_and_outputs_match_the_dense_model(up):
    rng = random.Random(5)
    prompts = [[rng.randrange(MODEL.vocab_size) for _ in range(40)] for _ in range(3)]
    router = up.router()
    assert router.route(prompts[0]) == deploy.Route("p0", 0)  # nothing cached: round-robin
    outputs = router.generate(prompts, max_tokens=6)  # p1, p0, p1
    assert_dense(prompts, outputs, 6)
    assert dict(router.routed) == {"p0": 1, "p1": 2}
    # The same prompt again goes where its two full blocks are cached, and hits them there.
    assert router.route(prompts[1]) == deploy.Route("p0", 32)
    again = router.generate([prompts[1], prompts[2]], max_tokens=6)
    assert again == [outputs[1], outputs[2]]
    assert dict(router.routed_by_prefix) == {"p0": 1, "p1": 1}
    stats = {s["pool_id"]: s for s in ray.get([e.stats.remote() for e in up.engines.values()])}
    assert stats["p0"]["hit_tokens"] == 32 and stats["p1"]["hit_tokens"] == 32
    assert stats["p0"]["requests"] == 2 and stats["p1"]["requests"] == 3 and stats["p0"]["backend"] == "torch"


def test_deploy_again_reuses_pools_and_adds_new_ones(up, config):
    config.add_pools = 1
    more = deploy.deploy(config)
    assert more.target == up.target and more.created == ["p2"] and list(more.engines) == ["p0", "p1", "p2"]
    assert all(more.engines[p]._actor_id == up.engines[p]._actor_id for p in ("p0", "p1"))
    router = more.router()
    prompt = [7] * 20
    assert_dense([prompt], router.generate([prompt], 3), 3)
    up.engines["p2"] = more.engines["p2"]  # not detached: a pool lives while its driver holds its engine


def test_deploy_stores_puts_a_kv_block_store_on_every_node(up, config, tmp_path_factory):
    """--stores: a store actor per node (for vLLM's KVServiceConnector), its pool on the allocator; teardown
    stops them and frees their shared memory."""
    shm = tmp_path_factory.mktemp("stores")
    config.add_pools, config.stores, config.store_pages, config.store_page_bytes = 0, True, 16, 64
    config.store_dir = str(shm)
    more = deploy.deploy(config)
    up.store_actors.update(more.store_actors)  # not detached: a store lives while its driver holds it
    assert len(more.stores) == 2 and len(set(more.stores.values())) == 2  # one per node
    from kvservice.blockstore.actor import actor_name
    for name, node in more.stores.items():
        assert ray.get(ray.get_actor(actor_name(name), namespace=deploy.NAMESPACE).descriptor.remote()).node_id == node
    with more.router().client as client:
        pools = client.get_stats().pools
    assert all(pools[f"kvstore:{n}"].num_blocks == 16 for n in more.stores)
    assert len(list(shm.glob("kvservice-store-*"))) == 4  # a segment and a descriptor each
    config.stores = False


def test_deploy_stores_take_the_allocators_block_size(cluster, tmp_path):
    """An allocator hashing 32-token blocks: stores take its block size when --block-size is not given, and a
    --block-size of 16 fails in one line naming both values (it failed deep in RegisterPool before)."""
    from tests.service_helpers import start_server
    server = start_server("--hash-block-size", "32", log_dir=tmp_path)
    try:
        cfg = deploy.DeployConfig(pools=0, allocator=server.target, stores=True, store_page_bytes=64, block_size=16,
                                  store_dir=str(tmp_path))
        with pytest.raises(RuntimeError, match=r"--block-size 16, but the allocator at .* hashes blocks of 32 "
                                               r"tokens .* pass 32"):
            deploy.deploy(cfg)
        cfg.block_size = None
        assert deploy.placement.block_size_for(cfg, server.target, 32) == 32
    finally:
        server.stop()


def test_teardown_removes_every_named_actor(up, config):
    names = deploy.teardown()
    assert deploy.ALLOCATOR_NAME in names and deploy.rank_name("p2", 0) in names and len(names) == 9
    assert sum(n.startswith("kvservice-store-") for n in names) == 2
    assert not list(Path(config.store_dir).glob("kvservice-store-*"))  # the stores freed their memory
    assert deploy.named_actors() == []
    groups = [g for g in ray.util.placement_group_table().values() if g["name"].startswith("kvservice-pool-")]
    assert groups and all(g["state"] == "REMOVED" for g in groups)


def test_cli_routes_deploy_to_worker_deploy():
    out = subprocess.run([sys.executable, "-m", "kvservice.cli", "deploy", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--add-pools" in out.stdout and "--teardown" in out.stdout


def test_deploy_configs_parse():
    """No cluster or kubectl server here: Ray's launcher schema for ray-cluster.yaml, YAML for the rest."""
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config
    validate_config(prepare_config(yaml.safe_load((REPO / "deploy" / "ray-cluster.yaml").read_text())))
    docs = {}
    for path in sorted((REPO / "deploy" / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"], doc["metadata"]["name"]] = doc
    assert {("RayCluster", "kvservice"), ("RayJob", "kvservice-pools"), ("Deployment", "kvservice-redis"),
            ("StatefulSet", "kvservice-shard-a"), ("StatefulSet", "kvservice-shard-b"),
            ("StatefulSet", "kvservice-redis-cluster"), ("Job", "kvservice-redis-cluster-create"),
            ("Service", "kvservice-redis"), ("PersistentVolumeClaim", "kvservice-redis"),
            ("Deployment", "kvservice-allocator"), ("Service", "kvservice-allocator")} <= set(docs)
    allocator = docs["Deployment", "kvservice-allocator"]["spec"]["template"]["spec"]["containers"][0]
    assert allocator["readinessProbe"]["grpc"]["port"] == 50051
    assert "redis://kvservice-redis:6379/0" in allocator["command"] and "--token-file" in allocator["command"]
    redis = docs["Deployment", "kvservice-redis"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert redis[:4] == ["--appendonly", "yes", "--appendfsync", "everysec"]


def _container_argv(container: dict, hostname: str, bin_dir: Path) -> list[str]:
    """What a manifest container runs, its `sh -c` script expanded by a real sh in pod `hostname` ($HOSTNAME
    and `hostname`), the program it execs replaced by one that prints its argv."""
    argv = container["command"] + container.get("args", [])
    if argv[:2] != ["sh", "-c"]:
        return argv
    program = argv[2].removeprefix("exec ").split()[0]
    bin_dir.mkdir(exist_ok=True)
    for name, body in ((program, 'printf "%s\\0" "$(basename "$0")" "$@"'), ("hostname", f"echo {hostname}")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    out = subprocess.run(["sh", "-c", argv[2]], capture_output=True, text=True, check=True,
                         env={"HOSTNAME": hostname, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    return out.stdout.split("\0")[:-1]


def _serve_settings(argv: list[str]):
    from kvservice.cli import build_parser
    from kvservice.settings import AllocatorSettings, ServerSettings, from_args
    assert argv[0] == "kvservice", argv
    args = build_parser().parse_args(argv[1:])  # an unknown flag or a bad value exits here
    assert args.command == "serve", argv
    return from_args(ServerSettings, args, allocator=from_args(AllocatorSettings, args))


def test_kuberay_shards_run_valid_commands(tmp_path):
    """allocator-shards.yaml: pod b-1 is a standby of shard s1 advertising its own DNS name, over the Redis
    Cluster of redis-cluster.yaml, whose node command a real redis-server 7 accepts in cluster mode."""
    import yaml

    from tests.redis_helpers import debian_redis, free_port
    docs = {}
    for name in ("allocator-shards.yaml", "redis-cluster.yaml", "rayjob-shards.yaml"):
        for doc in yaml.safe_load_all((REPO / "deploy" / "kuberay" / name).read_text()):
            docs[doc["kind"], doc["metadata"]["name"]] = doc
    sets = [docs["StatefulSet", f"kvservice-shard-{x}"]["spec"] for x in "ab"]
    assert sets[0]["replicas"] == sets[1]["replicas"] and sets[0]["selector"] != sets[1]["selector"]
    for x, spec in zip("ab", sets):
        assert spec["serviceName"] == "kvservice-shard-pods"
        settings = _serve_settings(_container_argv(spec["template"]["spec"]["containers"][0], f"kvservice-shard-{x}-1",
                                                   tmp_path / "bin"))
        assert (settings.shard_id, settings.standby) == ("s1", True)
        assert settings.advertise == f"kvservice-shard-{x}-1.kvservice-shard-pods:50051"
        assert settings.redis_url.startswith("rediscluster://kvservice-redis-cluster-0.kvservice-redis-cluster:")
        assert settings.token_file and settings.host == "0.0.0.0"
    assert docs["Service", "kvservice-shard-pods"]["spec"]["clusterIP"] == "None"
    job = docs["RayJob", "kvservice-pools-sharded"]["spec"]["entrypoint"].split()
    assert job[job.index("--allocator") + 1] == "kvservice-shards:50051"

    redis = docs["StatefulSet", "kvservice-redis-cluster"]["spec"]
    argv = _container_argv(redis["template"]["spec"]["containers"][0], "kvservice-redis-cluster-2", tmp_path / "bin")
    assert argv[0] == "redis-server" and "--cluster-enabled" in argv
    if debian_redis() is None:
        pytest.skip("Debian's redis-server 7 is not installed (make install installs it)")
    port = free_port(max_port=55535, bus_offset=10000)  # cluster mode: the bus listens on port + 10000
    argv = [debian_redis()] + [str(tmp_path) if a == "/data" else a for a in argv[1:]] + ["--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = redis_py.Redis(port=port, socket_connect_timeout=1)
        for _ in range(100):
            try:
                if client.ping():
                    break
            except redis_py.ConnectionError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        assert client.config_get("cluster-announce-hostname") == {
            "cluster-announce-hostname": "kvservice-redis-cluster-2.kvservice-redis-cluster"}
        assert client.info("cluster")["cluster_enabled"] == 1
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_deploy_local_smoke(tmp_path):
    out = subprocess.run([sys.executable, "-m", "worker.deploy", "--local", "--pools", "2", "--num-blocks", "64",
                          "--rank-cpus", "0.25", "--port", "0", "--data-dir", str(tmp_path), "--smoke", "8"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "smoke: 8 requests" in out.stdout and "(SERVING)" in out.stdout
    assert "dense reference: 8/8 outputs identical" in out.stdout

