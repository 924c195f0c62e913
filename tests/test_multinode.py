"""Two pools on two Ray nodes (one machine, `ray.cluster_utils.Cluster`): a prefix computed on node A is
reused on node B through a rank-to-rank transfer; killing A's workers re-registers A with a new epoch
while B keeps serving."""

import pytest

from tests.test_engine import MODEL, check, prompts
from worker.actor import PoolLayout, RayWorkers
from worker.engine import Engine, EngineConfig
from worker.model import TinyTransformer
from worker.sampling import SamplingParams

ray = pytest.importorskip("ray")
from worker.ray_local import joined_cluster  # noqa: E402

LAYOUT = "multinode-test"


@pytest.fixture(scope="module")
def cluster():
    with joined_cluster({"num_cpus": 1, "resources": {"node_a": 1}}, {"num_cpus": 1, "resources": {"node_b": 1}}) as c:
        yield c


def pool(server, pool_id, node):
    cfg = EngineConfig(pool_id=pool_id, num_blocks=64, block_size=16, max_model_len=512, max_num_batched_tokens=256,
                       allow_transfers=True, kv_layout=LAYOUT)
    layout = PoolLayout(MODEL, 64, 16, cfg.max_num_rows, cfg.max_num_blocks_per_req, 256)
    workers = RayWorkers(layout, num_cpus=0.25, resources={node: 0.1})
    return Engine(server.client(client_name=pool_id), workers, cfg, record_logits=True), layout


def test_two_nodes_transfer_and_epoch_restart(server, cluster):
    a, layout_a = pool(server, "node-a-pool", "node_a")
    b, _ = pool(server, "node-b-pool", "node_b")
    try:
        nodes = {ray.get(e.workers.actors[0].where.remote()) for e in (a, b)}
        assert len(nodes) == 2  # the pools' ranks live on different nodes
        a.peers[b.config.pool_id], b.peers[a.config.pool_id] = b.workers, a.workers
        prompt = prompts(1, 150, seed=41)[0]
        a.add_request(prompt, SamplingParams(max_tokens=3))
        a.run()
        seq = b.add_request(prompt + [1, 2], SamplingParams(max_tokens=4))
        b.run()
        assert b.stats.transfers == 1 and seq.transferred_tokens == 144
        assert b.stats.computed_tokens == (152 - 144) + 3  # node B computed only the suffix
        model = TinyTransformer(MODEL)
        check(model, a)
        check(model, b)

        # Node A's workers die mid-request: A restarts with a new epoch, B keeps serving meanwhile.
        victim = a.add_request(prompts(1, 60, seed=42)[0], SamplingParams(max_tokens=6))
        a.step()
        a.step()
        a.workers.shutdown()
        with pytest.raises(ray.exceptions.RayActorError):
            a.step()
        served = b.add_request(prompts(1, 40, seed=43)[0], SamplingParams(max_tokens=4))
        b.run()
        assert served.finished
        a.restart_pool(RayWorkers(layout_a, num_cpus=0.25, resources={"node_a": 0.1}))
        b.peers[a.config.pool_id] = a.workers
        a.run()
        assert victim.finished and victim.num_preemptions >= 1
        stats = a.client.get_stats(check_invariants=True)
        assert stats.pools[a.config.pool_id].epoch == 1
        check(model, a)
        check(model, b)
    finally:
        a.workers.shutdown()
        b.workers.shutdown()
