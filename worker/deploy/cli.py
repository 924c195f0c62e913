"""`kvservice deploy` / `python -m worker.deploy`: the service on an existing Ray cluster.

The allocator is a detached named actor on the head node that runs `kvservice serve` as a child process;
each pool's DCP ranks share one node through a STRICT_PACK placement group and pools spread over nodes;
an `EngineActor` per pool runs the scheduler beside its ranks; the driver's `Router` sends each prompt to
the pool holding its longest cached prefix (the allocator's Lookup). Every actor has a stable name in the
`kvservice` namespace, so running deploy again reuses what is up and only adds what is missing.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from kvservice.argparsing import Parser
from kvservice.blockstore.actor import live_ray_address
from kvservice.errors import KVServiceError
from worker.deploy.config import DeployConfig
from worker.deploy.names import NAMESPACE
from worker.deploy.placement import deploy, teardown
from worker.deploy.router import Router
from worker.model import ModelConfig, TinyTransformer
from worker.ray_local import init_local
from worker.ray_local import shutdown as shutdown_ray
from worker.request import EngineRequest
from worker.sampling import SamplingParams
from worker.verify import Verification, verify


def check(prompts: list[list[int]], outputs: list[list[int]], max_tokens: int) -> Verification:
    """Greedy outputs against the dense reference model (no cache)."""
    reqs = [EngineRequest(f"request-{i}", p + o, len(p), SamplingParams(max_tokens=max_tokens), 0)
            for i, (p, o) in enumerate(zip(prompts, outputs))]
    return verify(TinyTransformer(ModelConfig()), reqs)


def smoke(router: Router, num_requests: int, max_tokens: int = 8, seed: int = 0) -> bool:
    """Requests over one shared system prompt per pool, in waves of one request per pool: the first wave
    spreads them round-robin, later ones follow the cached prefixes. True when every output matched the
    dense reference."""
    import ray
    rng = random.Random(seed)
    vocab = ModelConfig().vocab_size
    systems = [[rng.randrange(vocab) for _ in range(64)] for _ in router.pool_ids]
    prompts = [systems[i % len(systems)] + [rng.randrange(vocab) for _ in range(rng.randint(8, 32))]
               for i in range(num_requests)]
    start = time.perf_counter()
    wave = len(router.pool_ids)
    outputs = []
    for i in range(0, num_requests, wave):
        outputs += router.generate(prompts[i:i + wave], max_tokens)
    elapsed = time.perf_counter() - start
    pools = router.client.get_stats().pools
    print(f"smoke: {num_requests} requests, {max_tokens} tokens each, in {elapsed:.1f} s")
    print(f"  {'pool':<6} {'node':<10} {'requests':>8} {'by prefix':>9} {'engine hit rate':>15} "
          f"{'allocator hit rate':>18}")
    for stats in ray.get([router.engines[p].stats.remote() for p in router.pool_ids]):
        p = stats["pool_id"]
        alloc = pools[p].prefix_hit_rate if p in pools else 0.0
        print(f"  {p:<6} {stats['node_id'][:8]:<10} {router.routed[p]:>8} {router.routed_by_prefix[p]:>9} "
              f"{stats['prefix_hit_rate']:>15.1%} {alloc:>18.1%}")
    result = check(prompts, outputs, max_tokens)
    print(f"  dense reference: {result.matched}/{result.sequences} outputs identical"
          + ("" if result.ok else f"  MISMATCH: {result.mismatches[:2]}"))
    return result.ok and all(len(o) == max_tokens for o in outputs)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, DeployConfig]:
    parser = Parser(prog="kvservice deploy", description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="auto", help="Ray cluster to join (default: auto, or $RAY_ADDRESS)")
    parser.add_argument("--local", action="store_true", help="start a local Ray cluster instead (to try it out; "
                        "everything stops when this command ends)")
    d = DeployConfig()
    parser.add_argument("--pools", type=int, help="pools p0..pN-1, existing ones reused (default: 2 on a cluster "
                        "with none, else the pools up)")
    parser.add_argument("--add-pools", type=int, default=0, metavar="K", help="K new pools after those up (scale out)")
    parser.add_argument("--dcp", type=int, default=d.dcp, help="DCP ranks per pool (one node per pool)")
    parser.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks per pool")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per block of the pools and stores (default: the allocator's "
                        "--hash-block-size; a store's must equal it)")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--backend", choices=["torch", "triton"], help="attention backend (default: triton "
                        "where the cluster has GPUs, the torch twin otherwise)")
    parser.add_argument("--rank-cpus", type=float, default=d.rank_cpus, help="CPUs per rank on CPU-only clusters")
    parser.add_argument("--host", default=None, help="allocator bind address (default: 0.0.0.0; with --local "
                        "127.0.0.1); beyond loopback without --token-file it generates a token and the engines and "
                        "the router get it")
    parser.add_argument("--insecure", action="store_true", help="beyond loopback: auth off instead (anyone who "
                        "reaches the head node can free every engine's blocks)")
    parser.add_argument("--port", type=int, default=d.port, help="allocator gRPC port on the head node")
    parser.add_argument("--allocator-shards", type=int, default=1, metavar="N",
                        help="N allocator shards (detached actors spread over the nodes; pools spread over the "
                             "shards); needs --redis-url")
    parser.add_argument("--standbys", action="store_true",
                        help="a hot standby beside each allocator shard, on another node; needs --redis-url")
    parser.add_argument("--data-dir", default=d.data_dir, help="the allocator's data dir (embedded Redis, a "
                        "generated token) on the head node (default: %(default)s: the allocator runs in a Ray actor "
                        "whose working directory is Ray's, so not `kvservice serve`'s ./kvservice-data)")
    parser.add_argument("--redis-url", help="use this Redis instead of the embedded one")
    parser.add_argument("--no-persistence", action="store_true", help="allocator memory-only")
    parser.add_argument("--token-file", help="allocator tokens file on the head node (auth on)")
    parser.add_argument("--token", default=os.environ.get("KVSERVICE_TOKEN"),
                        help="bearer token the engines and the router send (default: $KVSERVICE_TOKEN)")
    parser.add_argument("--tls-cert", help="the allocator's TLS certificate (PEM, on the head node); with "
                        "--tls-key turns TLS on (the allocator's --tls-cert)")
    parser.add_argument("--tls-key", help="the allocator's TLS private key (PEM, on the head node)")
    parser.add_argument("--tls-ca", help="the CA (PEM) that signed the allocator's certificate: the engines and "
                        "the router connect over TLS and trust it (with --allocator: an allocator elsewhere)")
    parser.add_argument("--allocator", metavar="HOST:PORT", help="use this running allocator, start none")
    parser.add_argument("--detached", action="store_true", help="pools outlive this command")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds to wait for room for new pools")
    parser.add_argument("--smoke", type=int, default=0, metavar="N", help="then run N requests through the router")
    parser.add_argument("--teardown", action="store_true", help="kill every kvservice actor and the allocator")
    parser.add_argument("--stores", action="store_true", help="a KV block store on every node, for vLLM engines "
                        "with KVServiceConnector (their extra config: store auto); --pools 0 for stores only")
    parser.add_argument("--store-pages", type=int, help=f"pages per store ({d.store_pages}; with --stores)")
    parser.add_argument("--store-page-bytes", type=int, default=0, help="bytes of one block of every layer of the "
                        "engines' model (needed with --stores)")
    parser.add_argument("--store-dir", help=f"each node's shared-memory dir ({d.store_dir}; with --stores)")
    parser.add_argument("--store-disk", metavar="DIR", help="each store's local-disk tier: page files in "
                        "DIR/<store name>/ on its node, kept across restarts (with --stores and --store-disk-bytes)")
    parser.add_argument("--store-disk-bytes", type=int, default=0, metavar="N",
                        help="each disk tier's byte budget (with --store-disk)")
    args = parser.parse_args(argv)
    cfg = DeployConfig(pools=args.pools, add_pools=args.add_pools, dcp=args.dcp, num_blocks=args.num_blocks,
                       block_size=args.block_size, max_model_len=args.max_model_len, backend=args.backend,
                       rank_cpus=args.rank_cpus,
                       host=args.host or ("127.0.0.1" if args.local else d.host), insecure=args.insecure,
                       port=args.port, data_dir=args.data_dir, redis_url=args.redis_url,
                       no_persistence=args.no_persistence, token_file=args.token_file, token=args.token,
                       tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                       allocator=args.allocator, allocator_shards=args.allocator_shards, standbys=args.standbys,
                       detached=args.detached, timeout_s=args.timeout, stores=args.stores,
                       store_pages=args.store_pages or d.store_pages, store_page_bytes=args.store_page_bytes,
                       store_dir=args.store_dir or d.store_dir, store_disk=args.store_disk,
                       store_disk_bytes=args.store_disk_bytes)
    return args, cfg


def refused(args: argparse.Namespace) -> str | None:
    """A flag that means nothing without another one (it would be ignored, or fail once Ray is up): what is
    wrong, naming both."""
    if args.teardown:
        return None
    if args.store_disk and args.store_disk_bytes <= 0:
        return "--store-disk needs --store-disk-bytes N (each disk tier's byte budget)"
    if args.store_disk_bytes and not args.store_disk:
        return "--store-disk-bytes is a disk tier's budget: it needs --store-disk DIR (where its page files go)"
    store_flags = [flag for flag, value in (("--store-pages", args.store_pages), ("--store-page-bytes",
                                            args.store_page_bytes), ("--store-dir", args.store_dir),
                                            ("--store-disk", args.store_disk),
                                            ("--store-disk-bytes", args.store_disk_bytes)) if value]
    if store_flags and not args.stores:
        return f"{', '.join(store_flags)}: the stores' settings, and no store is started without --stores"
    if args.stores and args.store_page_bytes <= 0:
        return ("--stores needs --store-page-bytes: one block of every layer of the engines' model "
                "(num_layers * num_kv_heads * block_size * 2 * head_dim * dtype bytes on vLLM's CPU attention)")
    if args.allocator:
        ignored = [flag for flag, value in (("--redis-url", args.redis_url), ("--token-file", args.token_file),
                                            ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                                            ("--no-persistence", args.no_persistence),
                                            ("--allocator-shards", args.allocator_shards > 1),
                                            ("--standbys", args.standbys)) if value]
        if ignored:
            return (f"{', '.join(ignored)}: settings of the allocator deploy starts, and with --allocator it "
                    f"starts none (give them to that allocator's kvservice serve)")
    elif (args.allocator_shards > 1 or args.standbys) and not args.redis_url:
        return ("--allocator-shards and --standbys need --redis-url: the shards and standbys share one Redis (or a "
                "Redis Cluster, rediscluster://host:port) that every node reaches")
    return None


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    if (why := refused(args)) is not None:
        print(f"kvservice deploy: {why}", file=sys.stderr)
        return 2
    if bool(cfg.tls_cert) != bool(cfg.tls_key) or (cfg.tls_cert and not cfg.tls_ca):
        print("kvservice deploy: TLS needs --tls-cert, --tls-key (the allocator's) and --tls-ca (what the engines "
              "and the router trust) together", file=sys.stderr)
        return 2
    import ray
    if args.local:
        init_local(namespace=NAMESPACE)
    else:
        try:
            ray.init(address=live_ray_address(args.address), namespace=NAMESPACE, log_to_driver=False,
                     configure_logging=False)
        except ConnectionError as exc:
            print(f"kvservice deploy: no Ray cluster at --address {args.address} ({exc}); start one "
                  f"(`ray start --head`) or try --local", file=sys.stderr)
            return 2
    try:
        if args.teardown:
            names = teardown()
            print(f"kvservice deploy: removed {len(names)} actors" + (f" ({', '.join(names)})" if names else ""))
            return 0
        try:
            up = deploy(cfg)
        except KVServiceError as exc:
            print(f"kvservice deploy: the allocator refused or did not answer: {exc}", file=sys.stderr)
            return 2
        except RuntimeError as exc:
            print(f"kvservice deploy: {exc}", file=sys.stderr)
            return 2
        where = "" if up.allocator is None or cfg.redis_url or cfg.no_persistence else \
            f", data dir {cfg.data_dir} on the head node"
        print(f"kvservice deploy: allocator {up.target}"
              + ("" if up.allocator is None else f" ({ray.get(up.allocator.health.remote())}){where}"))
        for name, node in up.stores.items():
            print(f"  store {name}: {cfg.store_pages} pages of {cfg.store_page_bytes} bytes on node {node[:8]} (pool "
                  f"kvstore:{name}; vLLM engines there: KVServiceConnector with store auto)")
        nodes = ray.get([e.where.remote() for e in up.engines.values()])
        for (pool_id, _), node in zip(up.engines.items(), nodes):
            state = "started" if pool_id in up.created else "reused"
            print(f"  pool {pool_id}: {cfg.dcp} rank(s) on node {node[:8]} ({state})")
        ok = smoke(up.router(cfg.token), args.smoke) if args.smoke else True
        if up.created and not cfg.detached and not args.local:
            print("  (not --detached: the pools stop when this command exits; the allocator stays up)")
        return 0 if ok else 1
    finally:
        if args.local:
            teardown()  # stops the allocator's server (and its Redis) in order before the cluster goes
        shutdown_ray()


if __name__ == "__main__":
    sys.exit(main())
