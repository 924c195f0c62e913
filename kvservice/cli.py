"""`kvservice serve | status | demo | generate | bench | deploy`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
from pathlib import Path

from kvservice.hashing import DEFAULT_HASH_BLOCK_SIZE, DEFAULT_HASH_SEED


def _quota(text: str) -> tuple[str, int]:
    tenant, _, blocks = text.partition("=")
    if not tenant or not blocks.isdigit():
        raise argparse.ArgumentTypeError(f"--quota wants TENANT=BLOCKS, got {text!r}")
    return tenant, int(blocks)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvservice", description="Distributed KV-cache service for LLM serving")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the allocator service")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    serve.add_argument("--data-dir", default="./kvservice-data", help="embedded Redis data (persistence)")
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    serve.add_argument("--token-file", help="bearer tokens, lines 'token tenant [admin]' (default: auth off)")
    serve.add_argument("--tls-cert")
    serve.add_argument("--tls-key")
    serve.add_argument("--tls-ca", help="client CA: turns on mutual TLS")
    serve.add_argument("--hash-block-size", type=int, default=DEFAULT_HASH_BLOCK_SIZE)
    serve.add_argument("--hash-seed", default=DEFAULT_HASH_SEED)
    serve.add_argument("--session-ttl", type=float, default=30.0, help="lease TTL in seconds")
    serve.add_argument("--event-retention", type=int, default=100_000, help="events kept for WatchEvents resume")
    serve.add_argument("--quota", type=_quota, action="append", default=[], metavar="TENANT=BLOCKS",
                       help="per-tenant block quota (repeatable)")
    serve.add_argument("--max-message-mb", type=int, default=64)
    serve.add_argument("--max-requests-per-session", type=int, default=1_000_000,
                       help="live requests one session may hold (more: RESOURCE_EXHAUSTED per op)")
    serve.add_argument("--max-pool-blocks", type=int, default=1 << 22,
                       help="largest pool RegisterPool accepts (blocks; each costs ~150 bytes of allocator memory)")
    serve.add_argument("--min-transfer-tokens", type=int, default=64,
                       help="propose a cross-pool prefix transfer only when it saves at least this many tokens")
    persist = serve.add_argument_group("persistence (DESIGN §6)")
    persist.add_argument("--redis-url", help="use this Redis (default: a private redis-server in --data-dir)")
    persist.add_argument("--no-persistence", action="store_true", help="memory only: a restart loses everything")
    persist.add_argument("--require-persistence", action="store_true",
                         help="refuse mutations (UNAVAILABLE) while Redis is down instead of serving degraded")
    persist.add_argument("--redis-fsync", choices=["everysec", "always", "no"], default="everysec",
                         help="embedded Redis AOF fsync: everysec loses up to ~1 s if the Redis host dies, "
                              "always loses nothing")
    persist.add_argument("--redis-namespace", default="kvservice")
    persist.add_argument("--snapshot-every", type=int, default=50_000, help="snapshot after this many WAL entries")
    persist.add_argument("--snapshot-interval", type=float, default=60.0, help="...or this many seconds")
    persist.add_argument("--snapshot-mode", choices=["standby", "fork"], default="standby",
                         help="standby: a process that replays the WAL writes snapshots (serving never pauses); "
                              "fork: a forked child serializes this process's memory")
    persist.add_argument("--reset-state", action="store_true", help="delete the stored state and start empty")

    status = sub.add_parser("status", help="print pools, usage and hit rate")
    status.add_argument("--target", default="127.0.0.1:50051")
    status.add_argument("--token")
    status.add_argument("--tls-ca")
    status.add_argument("--check-invariants", action="store_true")

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
    from kvservice.server.app import ServerConfig, serve
    config = ServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port, token_file=args.token_file,
                          tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                          hash_block_size=args.hash_block_size, hash_seed=args.hash_seed,
                          session_ttl_s=args.session_ttl, event_retention=args.event_retention,
                          quotas=dict(args.quota), max_message_bytes=args.max_message_mb << 20,
                          min_transfer_tokens=args.min_transfer_tokens,
                          max_requests_per_session=args.max_requests_per_session,
                          max_pool_blocks=args.max_pool_blocks,
                          data_dir=args.data_dir, persistence=not args.no_persistence, redis_url=args.redis_url,
                          redis_namespace=args.redis_namespace, redis_fsync=args.redis_fsync,
                          require_persistence=args.require_persistence, snapshot_every=args.snapshot_every,
                          snapshot_interval_s=args.snapshot_interval, snapshot_mode=args.snapshot_mode,
                          reset_state=args.reset_state)
    try:
        return asyncio.run(serve(config))
    except (ConnectionError, ValueError) as exc:
        logging.getLogger("kvservice").error("%s", exc)
        print(f"kvservice serve: {exc}", file=sys.stderr)
        return 2


def cmd_status(args: argparse.Namespace) -> int:
    from kvservice.client import KVServiceClient
    from kvservice.errors import KVServiceError
    try:
        with KVServiceClient(args.target, args.token, tls_ca=args.tls_ca, retries=1, timeout_s=5) as client:
            stats = client.get_stats(check_invariants=args.check_invariants)
    except KVServiceError as exc:
        print(f"kvservice at {args.target}: {exc}", file=sys.stderr)
        return 1
    print(f"kvservice at {args.target}: {len(stats.pools)} pools, {stats.num_sessions} sessions, "
          f"persistence {stats.persistence}, hash spec {stats.hash_fingerprint} (block {stats.hash_block_size})")
    rows = [("pool", "epoch", "blocks", "free", "usage", "requests", "cached", "hit rate", "evictions", "invariants")]
    for p in stats.pools.values():
        inv = "" if not args.check_invariants else ("ok" if not p.invariant_violation else p.invariant_violation)
        rows.append((p.pool_id, str(p.epoch), str(p.num_blocks - 1), str(p.num_free_blocks), f"{p.usage:.1%}",
                     str(p.num_requests), str(p.num_cached_blocks), f"{p.prefix_hit_rate:.1%}", str(p.evictions), inv))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    return subprocess.call([sys.executable, str(Path(__file__).resolve().parent.parent / "bench" / "run_all.py")])


def cmd_demo(args: argparse.Namespace) -> int:
    from worker.demo import main as demo_main  # the workers (torch, Ray) load only for the demo
    return demo_main(args.demo_args)


def cmd_generate(args: argparse.Namespace) -> int:
    from worker.generate import main as generate_main  # torch and transformers load only for generate
    return generate_main(args.demo_args)


def cmd_deploy(args: argparse.Namespace) -> int:
    from worker.deploy import main as deploy_main  # Ray and torch load only for deploy
    return deploy_main(args.deploy_args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("demo", "deploy", "generate"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.demo_args = args.deploy_args = extra
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"serve": cmd_serve, "status": cmd_status, "demo": cmd_demo, "bench": cmd_bench,
            "deploy": cmd_deploy, "generate": cmd_generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
