"""The engine with real Ray actors: one pool of 2 DCP ranks joined by a gloo group."""

import pytest

from tests.test_engine import MODEL, check, prompts
from worker.actor import PoolLayout, RayWorkers
from worker.engine import Engine, EngineConfig
from worker.model import TinyTransformer
from worker.ray_local import init_local, shutdown
from worker.sampling import SamplingParams

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    init_local(num_cpus=2)
    yield
    shutdown()


def test_dcp2_ray_actors_match_the_dense_model(server, ray_cluster):
    cfg = EngineConfig(pool_id="ray-dcp2", num_blocks=96, block_size=16, dcp_world_size=2, max_model_len=512,
                       max_num_batched_tokens=128, max_num_seqs=8)
    layout = PoolLayout(MODEL, cfg.num_blocks, cfg.block_size, cfg.max_num_rows, cfg.max_num_blocks_per_req,
                        cfg.max_num_batched_tokens, dcp_world_size=2)
    workers = RayWorkers(layout, num_cpus=0.5)
    try:
        eng = Engine(server.client(), workers, cfg, record_logits=True)
        for p in prompts(3, 45, seed=21, shared=32):
            eng.add_request(p, SamplingParams(max_tokens=5))
        eng.add_request(prompts(1, 30, seed=22)[0], SamplingParams(max_tokens=5, n=2, temperature=0.7, seed=3))
        eng.run()
        assert len(eng.finished) == 5 and eng.stats.hit_tokens >= 32 and eng.stats.copies >= 1
        check(TinyTransformer(MODEL), eng)
    finally:
        workers.shutdown()
