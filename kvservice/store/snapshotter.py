"""The standby snapshot writer: a separate process that tails the WAL like a replica.

It loads the current snapshot, replays the WAL entries after it through the same code as recovery (the
allocator is deterministic, so it reaches the leader's state as of the last entry), writes the result
as the new snapshot covering that entry and trims the WAL behind it. The serving process never stops,
forks or serializes for a periodic snapshot: only a resync after a Redis outage (whose mutations were
never logged) needs the leader's own memory. Writes are fenced with the leader's epoch, so a standby of
a replaced leader can do no harm and exits.

    python -m kvservice.store.snapshotter --redis-url URL --namespace NS --epoch E [allocator flags]
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from kvservice.allocator import Allocator
from kvservice.argparsing import Parser
from kvservice.settings import AllocatorSettings, add_arguments, from_args
from kvservice.store import wal
from kvservice.store.recovery import recover
from kvservice.store.redis_store import FencedError, RedisStore
from kvservice.store.snapshot import dump

logger = logging.getLogger("kvservice.snapshotter")
WRITER = "standby"


async def snapshot_once(store: RedisStore, settings: AllocatorSettings) -> dict | None:
    """Writes a snapshot covering the WAL as it is now; None when there is nothing new or the WAL has an
    unresolved gap (the leader resyncs that one from its memory)."""
    snapshot, covered, entries = await store.load()
    if not entries:
        return None
    if any(wal.is_resync(raw) for _, raw in entries):
        return None
    start = time.perf_counter()
    allocator = Allocator(settings)
    info = recover(allocator, snapshot, entries)
    data = dump(allocator)
    last_id = entries[-1][0]
    await store.write_pending(WRITER, data)
    left = await store.commit_snapshot(last_id, WRITER)
    return {"entries": info["replayed"], "bytes": len(data), "wal_left": left, "seconds": time.perf_counter() - start}


async def run(url: str, namespace: str, epoch: int, settings: AllocatorSettings, every: int, interval_s: float,
              poll_s: float = 0.25) -> int:
    store = RedisStore(url, namespace, socket_timeout_s=30)
    store.epoch = epoch
    last = time.monotonic()
    try:
        while True:
            await asyncio.sleep(poll_s)
            try:
                if await store.leader() != epoch:
                    logger.info("the leader is no longer epoch %d: exiting", epoch)
                    return 0
                pending = await store.redis.xlen(store.k_wal)
                # The entry a snapshot covers stays in the stream, so one entry means nothing new.
                if pending <= 1 or (pending < every and time.monotonic() - last < interval_s):
                    continue
                result = await snapshot_once(store, settings)
                last = time.monotonic()
                if result is not None:
                    logger.info("snapshot: %(entries)d entries replayed, %(bytes)d bytes, %(wal_left)d WAL "
                                "entries left, %(seconds).3f s", result)
            except FencedError:
                logger.info("fenced: a newer leader owns %s", namespace)
                return 0
            except Exception as exc:  # Redis away, say: try again later
                logger.warning("snapshot attempt failed: %r", exc)
                last = time.monotonic()
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--namespace", default="kvservice")
    parser.add_argument("--epoch", type=int, required=True)
    parser.add_argument("--every", type=int, default=50_000)
    parser.add_argument("--interval", type=float, default=60.0)
    add_arguments(parser, AllocatorSettings)  # the leader passes its own (AllocatorSettings.to_argv)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.nice(10)  # replaying must not take CPU time from serving
    settings = from_args(AllocatorSettings, args)
    return asyncio.run(run(args.redis_url, args.namespace, args.epoch, settings, args.every, args.interval))


if __name__ == "__main__":
    sys.exit(main())
