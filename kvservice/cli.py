"""`kvservice serve | status | shards | store | route | demo | generate | bench | deploy`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
from pathlib import Path

from kvservice.argparsing import Parser
from kvservice.settings import AllocatorSettings, ServerSettings, add_arguments, from_args

STATUS_FAILED = 1  # `kvservice status`: nothing answered
STATUS_DEGRADED = 3  # `kvservice status`: some shards answered, others are down
NULL_BLOCK_NOTE = ("(blocks: usable blocks, the pool's num_blocks less 1: block 0 is the null block, which "
                   "padding and skipped window blocks point at, and is never handed out)")
SUSPENDED_NOTE = ("(suspended: the session that registered the pool ended, and it was registered to outlive it, as "
                  "a store's disk tier is: its blocks and index are kept, but it answers no hit and takes no "
                  "allocation until its store registers it again)")
ENDPOINT_NOTE = ("(endpoint: the size of the transport endpoint a store published for its pool, its NIXL agent "
                 "metadata: engines on other nodes read that store's pages over NIXL; none, on a store's pool: "
                 "through the store's Ray actor)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvservice", description="Distributed KV-cache service for LLM serving")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    serve = sub.add_parser("serve", help="run the allocator service")
    add_arguments(serve, ServerSettings)
    add_arguments(serve, AllocatorSettings)

    status = sub.add_parser("status", help="print pools, usage and hit rate",
                            description="Pools, usage and hit rate of an allocator (sharded: of every shard, and "
                                        "each shard's state); per pool also whether it is suspended (a store's "
                                        "disk tier whose store is away) and the size of the endpoint its store "
                                        "published (none: other nodes read it through Ray).",
                            epilog=f"exit status: 0 every shard answered; {STATUS_DEGRADED} degraded: some shards "
                                   f"did not answer (listed as down; the others' pools are shown); {STATUS_FAILED} "
                                   "nothing answered (or the call was refused); 2 bad usage")
    status.add_argument("--target", default="127.0.0.1:50051", help="the allocator (default: %(default)s)")
    status.add_argument("--token", help="bearer token (a line of the server's --token-file)")
    status.add_argument("--token-file", help="read the bearer token from this file (its first token)")
    status.add_argument("--tls-ca", help="CA that signed the server's certificate (PEM): turns on TLS")
    status.add_argument("--tls-cert", help="client certificate (PEM), for a server with --tls-ca (mutual TLS)")
    status.add_argument("--tls-key", help="client private key (PEM)")
    status.add_argument("--check-invariants", action="store_true", help="walk every block (admin token)")

    shards = sub.add_parser("shards", help="a sharded allocator's map, and moving pools between its shards")
    shards.add_argument("action", choices=["list", "rebalance", "move"],
                        help="list: pools per shard; rebalance: even them out; move: one pool (--pool, --to)")
    shards.add_argument("--target", default="127.0.0.1:50051", help="any shard (default: %(default)s)")
    shards.add_argument("--token", help="an admin bearer token (rebalance, move)")
    shards.add_argument("--token-file", help="read the bearer token from this file (its first token)")
    shards.add_argument("--tls-ca", help="CA that signed the servers' certificates (PEM): turns on TLS")
    shards.add_argument("--tls-cert", help="client certificate (PEM), for mutual TLS")
    shards.add_argument("--tls-key", help="client private key (PEM)")
    shards.add_argument("--pool", help="move: the pool")
    shards.add_argument("--to", help="move: the destination shard")
    shards.add_argument("--dry-run", action="store_true", help="rebalance: print the moves, make none")

    store = sub.add_parser("store", help="a KV block store on this node (the store tier of vLLM's KVServiceConnector) "
                                         "where Ray is absent; runs until SIGTERM or Ctrl-C",
                           description="A KV block store: a shared-memory segment of pages here and its pool "
                                       "kvstore:NAME on the allocator; vLLM engines on this node with "
                                       "KVServiceConnector (store NAME) save and load prefixes through it.")
    store.add_argument("--name", required=True, help="the store's name (its pool: kvstore:NAME)")
    store.add_argument("--target", default="127.0.0.1:50051", help="the allocator (default: %(default)s)")
    store.add_argument("--pages", type=int, required=True, help="pages of the segment (page 0 is never used)")
    store.add_argument("--page-bytes", type=int, required=True,
                       help="one block of every layer of the engines' model (num_layers * num_kv_heads * "
                            "block_size * 2 * head_dim * dtype bytes on vLLM's CPU attention)")
    store.add_argument("--block-size", type=int, required=True, help="the engines' block size (= the allocator's "
                                                                     "--hash-block-size)")
    store.add_argument("--dir", default="/dev/shm", help="where the segment lives (default: %(default)s)")
    store.add_argument("--store-disk", metavar="DIR", help="a local-disk tier under the RAM pages: page files in DIR "
                       "(pool kvdisk:NAME), kept across restarts")
    store.add_argument("--store-disk-bytes", type=int, default=0, metavar="N",
                       help="the disk tier's byte budget (needs --store-disk)")
    store.add_argument("--token", help="bearer token: the store's pool belongs to its tenant")
    store.add_argument("--token-file", help="read the bearer token from this file (its first token)")
    store.add_argument("--tls-ca", help="CA that signed the server's certificate (PEM): turns on TLS")

    sub.add_parser("route", help="an OpenAI-compatible router in front of stock vLLM servers (KV-aware, P/D, "
                                "health-checked); options after it go to kvservice.router (--backend, --policy, ...)",
                   add_help=False)
    sub.add_parser("demo", help="end-to-end demo (allocator + Ray workers + a tiny model); options after it go "
                               "to worker/demo.py (e.g. --requests, --dcp, --backend, --num-blocks)", add_help=False)
    sub.add_parser("generate", help="generate with a Hugging Face checkpoint on kvservice's paged KV; options after "
                                   "it go to worker/generate.py (--model DIR, --prompt or --prompt-ids, --max-tokens)",
                   add_help=False)
    sub.add_parser("bench", help="run every benchmark (same as `make bench`)")
    sub.add_parser("deploy", help="bring the allocator, pools and engines up on a Ray cluster; options after it go "
                                 "to worker/deploy.py (e.g. --address, --pools, --add-pools, --smoke, --teardown)",
                   add_help=False)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from kvservice.server.serve import serve
    config = from_args(ServerSettings, args, allocator=from_args(AllocatorSettings, args))
    try:
        return asyncio.run(serve(config))
    except (ConnectionError, ValueError) as exc:
        print(f"kvservice serve: {exc}", file=sys.stderr)
        return 2


def client_token(args: argparse.Namespace, command: str) -> str | None | bool:
    """--token, or the first token of --token-file; False (after a one-line error) when that file is unusable."""
    if args.token or not args.token_file:
        return args.token
    try:
        return Path(args.token_file).read_text().split()[0]
    except (OSError, UnicodeDecodeError, IndexError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "no token in it"
        print(f"kvservice {command}: --token-file {args.token_file}: cannot read a token ({why})", file=sys.stderr)
        return False


def cmd_status(args: argparse.Namespace) -> int:
    from kvservice.client import KVServiceClient
    from kvservice.client.base import merge_stats
    from kvservice.errors import Code, KVServiceError
    token = client_token(args, "status")
    if token is False:
        return 2
    try:
        with KVServiceClient(args.target, token, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                             retries=1, timeout_s=5) as client:
            per_shard = client.shard_stats(check_invariants=args.check_invariants, missing_ok=True)
            addresses = {c.shard_id: c.address for c in client.shards.all()}
    except KVServiceError as exc:
        hint = ""
        if exc.code is Code.UNAVAILABLE:
            hint = (" (unavailable: is it listening there, and does it want TLS? --tls-ca for TLS, plus "
                    "--tls-cert/--tls-key when the server has --tls-ca)")
        print(f"kvservice at {args.target}: {exc.code.name}: {exc}{hint}", file=sys.stderr)
        return STATUS_FAILED
    down = {s: e for s, e in per_shard.items() if isinstance(e, KVServiceError)}
    stats = merge_stats([s for s in per_shard.values() if not isinstance(s, KVServiceError)])
    print(f"kvservice at {args.target}: {len(stats.pools)} pools, {stats.num_sessions} sessions, "
          f"persistence {stats.persistence}, hash spec {stats.hash_fingerprint} (block {stats.hash_block_size})")
    rows = [("pool", "epoch", "blocks", "free", "usage", "requests", "cached", "hit rate", "evictions", "state",
             "endpoint", "invariants")]
    for p in stats.pools.values():
        inv = "" if not args.check_invariants else ("ok" if not p.invariant_violation else p.invariant_violation)
        state = "suspended" if p.suspended else f"moving to {p.moving_to}" if p.moving_to else "active"
        endpoint = p.endpoint_size or len(p.endpoint)  # the bytes only for the pool's tenant: never printed
        rows.append((p.pool_id, str(p.epoch), str(p.num_blocks - 1), str(p.num_free_blocks), f"{p.usage:.1%}",
                     str(p.num_requests), str(p.num_cached_blocks), f"{p.prefix_hit_rate:.1%}", str(p.evictions),
                     state, f"{endpoint} B" if endpoint else "none", inv))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if stats.pools:
        print(NULL_BLOCK_NOTE)
    if any(p.suspended for p in stats.pools.values()):
        print(SUSPENDED_NOTE)
    if any(p.endpoint_size or p.endpoint for p in stats.pools.values()):
        print(ENDPOINT_NOTE)
    if len(per_shard) > 1 or down:
        for shard_id, s in per_shard.items():
            state = (f"down ({s.code.name}: {s}); its pools are not listed" if shard_id in down
                     else f"up, {len(s.pools)} pools, persistence {s.persistence}")
            print(f"shard {shard_id} at {addresses.get(shard_id, '?')}: {state}")
    if down:
        print(f"kvservice at {args.target}: degraded: {len(down)} of {len(per_shard)} shards did not answer "
              f"({', '.join(sorted(down))})", file=sys.stderr)
        return STATUS_DEGRADED
    return 0


def cmd_shards(args: argparse.Namespace) -> int:
    from kvservice.client import KVServiceClient
    from kvservice.errors import KVServiceError
    from kvservice.shards.rebalance import Rebalancer
    token = client_token(args, "shards")
    if token is False:
        return 2
    with KVServiceClient(args.target, token, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                         retries=1, timeout_s=10) as client:
        try:
            shard_map = client.shard_map()
            if not shard_map.sharded:
                print(f"kvservice shards: {args.target} is not sharded (kvservice serve --shard)", file=sys.stderr)
                return 2
            if args.action == "list":
                for info in shard_map.shards:
                    pools = sorted(p for p, s in shard_map.pools.items() if s == info.shard_id)
                    print(f"{info.shard_id}  {info.address}  epoch {info.epoch}  {len(pools)} pools: "
                          f"{' '.join(pools)}")
                return 0
            rebalancer = Rebalancer(client)
            if args.action == "move":
                if not args.pool or not args.to:
                    print("kvservice shards move: give --pool and --to", file=sys.stderr)
                    return 2
                if args.pool not in shard_map.pools:
                    print(f"kvservice shards move: no pool {args.pool!r} in the shard map", file=sys.stderr)
                    return 2
                moved = rebalancer.move_to(args.pool, args.to)  # finishes interrupted moves first
                results = [moved] if moved is not None else []
                if moved is None:
                    print(f"{args.pool} is on {args.to} already")
            else:
                results = rebalancer.rebalance(args.dry_run)
            for line in rebalancer.finished:
                print(line)
            for r in results:
                if isinstance(r, tuple):
                    print(f"would move {r[0]}: {r[1]} -> {r[2]}")
                else:
                    print(f"moved {r.pool_id}: {r.from_shard} -> {r.to_shard} ({r.num_requests} requests, "
                          f"{r.export_bytes:,} bytes, {r.seconds * 1000:.0f} ms)")
            if not results and args.action == "rebalance":
                print("kvservice shards: balanced, nothing to move")
        except KVServiceError as exc:
            print(f"kvservice shards: {exc.code.name}: {exc}", file=sys.stderr)
            return 1
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    return subprocess.call([sys.executable, str(Path(__file__).resolve().parent.parent / "bench" / "run_all.py")])


def cmd_demo(args: argparse.Namespace) -> int:
    from worker.demo import main as demo_main  # the workers (torch, Ray) load only for the demo
    return demo_main(args.demo_args)


def cmd_store(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvservice.blockstore import BlockStore
    from kvservice.errors import KVServiceError
    token = client_token(args, "store")
    if token is False:
        return 2
    try:
        if args.store_disk and args.store_disk_bytes <= 0:
            raise ValueError("--store-disk needs --store-disk-bytes N (the disk tier's byte budget)")
        if args.store_disk_bytes and not args.store_disk:
            raise ValueError("--store-disk-bytes is the disk tier's budget: it needs --store-disk DIR (where its "
                             "page files go)")
        store = BlockStore(args.name, args.target, args.pages, args.page_bytes, args.block_size, token=token,
                           directory=args.dir, tls_ca=args.tls_ca, disk_dir=args.store_disk,
                           disk_bytes=args.store_disk_bytes)
    except (KVServiceError, ValueError, OSError) as exc:
        print(f"kvservice store: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    disk = "" if store.disk is None else (f"; disk tier {store.disk.pool_id}: {store.disk.info.num_pages} pages in "
                                          f"{store.disk.directory}, {store.disk.num_verified} verified")
    print(f"kvservice store {args.name}: pool {store.pool_id} at epoch {store.generation}, {args.pages} pages of "
          f"{args.page_bytes} bytes in {store.descriptor.path}{disk}", flush=True)
    try:
        stop.wait()
    finally:
        store.close()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from worker.generate import main as generate_main  # torch and transformers load only for generate
    return generate_main(args.demo_args)


def cmd_route(args: argparse.Namespace) -> int:
    from kvservice.router.cli import main as route_main  # aiohttp loads only for the router
    return route_main(args.demo_args)


def cmd_deploy(args: argparse.Namespace) -> int:
    from worker.deploy import main as deploy_main  # Ray and torch load only for deploy
    return deploy_main(args.deploy_args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("demo", "deploy", "generate", "route"):
        subcommand = parser._subparsers._group_actions[0].choices[args.command]
        subcommand.error(f"unrecognized arguments: {' '.join(extra)}")  # its usage, and the flag meant
    args.demo_args = args.deploy_args = extra
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"serve": cmd_serve, "status": cmd_status, "shards": cmd_shards, "store": cmd_store, "demo": cmd_demo,
            "bench": cmd_bench, "deploy": cmd_deploy, "generate": cmd_generate, "route": cmd_route}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
