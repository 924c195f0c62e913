"""A router's replica of the allocator's prefix index, so that routing a prompt costs no RPC.

    index = PrefixIndex(client)            # follows each shard's WatchEvents (include_state), in threads
    result = index.lookup(token_ids)       # what client.lookup answers, from memory
    index.close()

Each shard's stream starts with the state of its pools (a dump taken atomically with the stream's start) and
goes on with every change, so a replica that applied its stream holds exactly the cached block hashes of every
pool the client's tenant sees, as of the last event it received (measured here: a few milliseconds behind;
`bench/shard_bench.py`). While a shard's stream is not synced (starting, after a pool moved onto it or started
a new epoch) its pools are answered by a Lookup RPC to that shard, as are pools whose hits a replica cannot
compute (several KV groups, blocks larger than hash blocks, a hash spec of their own such as vLLM's; their
`PoolStats.plain_prefix` is false) and external pools. Free-block counts (the tie-break of `best_pool`) and
whether a pool is suspended (its store away: no hit, its hashes kept for when it resumes) are refreshed every
`refresh_s`. A stream that broke (its shard's leader died) leaves the hashes as they were: its pools are
answered from them until the stream is back (a standby took over with the same state), stale by what changed
meanwhile, rather than by an RPC to a shard that may be failing over for a while.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence

from kvservice.client.streams import EventStream
from kvservice.client.sync import KVServiceClient
from kvservice.results import LookupResult, PoolHit, PoolStats, best_pool

logger = logging.getLogger(__name__)


class _Shard:
    """One shard's stream and what it rebuilt."""

    def __init__(self, shard_id: str) -> None:
        self.shard_id = shard_id
        self.synced = False
        self.stream: EventStream | None = None
        self.restart = False  # set by the refresher: resync (a pool moved here, an epoch changed)
        self.broken = False  # its stream broke: its pools answer from the hashes as they were until it resyncs
        self.applied_sequence = 0  # the newest event applied (the dump's sequence, then each event's)
        self.resyncs = 0


class PrefixIndex:
    """The prefix index of every pool `client`'s tenant sees, kept in memory from the shards' events."""

    def __init__(self, client: KVServiceClient, refresh_s: float = 1.0) -> None:
        self.client, self.refresh_s = client, refresh_s
        self._lock = threading.Lock()
        # pool -> its cached block hashes (group 0), each with how many blocks carry it (a pool may cache two
        # equal blocks; evicting one leaves the hash cached)
        self._hashes: dict[str, dict[bytes, int]] = {}
        self._pool_shard: dict[str, str] = {}  # pool -> shard, as of the last refresh
        self._stats: dict[str, PoolStats] = {}
        self._external: list[str] = []
        self._block_size = client.hash_block_size
        self._shards: dict[str, _Shard] = {}
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self.remote_lookups = 0  # Lookup RPCs made for pools this replica could not answer
        self._refresh()
        refresher = threading.Thread(target=self._refresh_loop, name="prefix-index-refresh", daemon=True)
        refresher.start()
        self._threads.append(refresher)

    def close(self) -> None:
        self._closed.set()
        for shard in list(self._shards.values()):
            if shard.stream is not None:
                shard.stream.cancel()
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> PrefixIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- answers -------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int] | None = None, block_hashes: Sequence[bytes] | None = None,
               num_tokens: int = 0, cache_salt: str | None = None, lora_name: str | None = None,
               pool_ids: Sequence[str] = ()) -> LookupResult:
        """As `KVServiceClient.lookup`: per pool the cached prefix tokens, and the best pool."""
        bs = self._block_size
        if block_hashes is None:
            raw = self.client.hash_prompt(token_ids, cache_salt, lora_name)
            num_tokens = len(token_ids)
        else:
            raw = list(block_hashes)
            num_tokens = num_tokens or len(raw) * bs
        wanted = list(pool_ids) if pool_ids else [*self._stats, *self._external]
        prefix = raw[:max(0, num_tokens - 1) // bs]  # the last token is always computed: a hit stops short
        hits, remote = [], []
        with self._lock:
            for pool_id in wanted:
                held = self._local(pool_id)
                if held is None:
                    remote.append(pool_id)
                    continue
                stats = self._stats[pool_id]
                if stats.suspended:  # its store is away (as of the last refresh): no hit, never the best pool
                    hits.append(PoolHit(pool_id, 0, stats.num_free_blocks, len(held), suspended=True))
                    continue
                n = 0
                for h in prefix:
                    if h not in held:
                        break
                    n += 1
                hits.append(PoolHit(pool_id, n * bs, stats.num_free_blocks, len(held)))
        missing = []
        if remote:
            self.remote_lookups += 1
            answer = self.client.lookup(token_ids, block_hashes, num_tokens, cache_salt, lora_name, remote)
            hits, missing = hits + answer.hits, answer.missing_shards
        return LookupResult(hits, best_pool(hits, raw[0] if raw else None), missing)

    def pool_stats(self, pool_id: str) -> PoolStats | None:
        """The pool's stats as of the last refresh (its epoch, free blocks, the endpoint its tenant is handed),
        or None for a pool not seen."""
        with self._lock:
            return self._stats.get(pool_id)

    def _local(self, pool_id: str) -> dict[bytes, int] | None:
        """The pool's replicated hashes, or None when this replica cannot answer for it now."""
        stats = self._stats.get(pool_id)
        shard = self._shards.get(self._pool_shard.get(pool_id, ""))
        if stats is None or not stats.plain_prefix or shard is None or not (shard.synced or shard.broken):
            return None
        return self._hashes.get(pool_id, {})

    def synced(self) -> bool:
        """Whether every shard's stream is synced (every plain pool answered from memory)."""
        with self._lock:
            shards = list(self._shards.values())
        return bool(shards) and all(s.synced for s in shards)

    def wait_synced(self, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.synced():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def applied_sequence(self, shard_id: str = "") -> int:
        """The newest event of `shard_id` ("" unsharded) this replica has applied."""
        shard = self._shards.get(shard_id)
        return shard.applied_sequence if shard is not None else 0

    def resyncs(self, shard_id: str = "") -> int:
        """How often `shard_id`'s stream was started again (a failover, a pool moved onto it, ...)."""
        shard = self._shards.get(shard_id)
        return shard.resyncs if shard is not None else 0

    def approx_bytes(self) -> int:
        """Memory the replicated hashes take (the dicts and the hash objects)."""
        with self._lock:
            return sum(sys.getsizeof(held) + sum(sys.getsizeof(h) for h in held) for held in self._hashes.values())

    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(h) for h in self._hashes.values())

    # ---- keeping up ----------------------------------------------------------------------------
    def _refresh_loop(self) -> None:
        while not self._closed.wait(self.refresh_s):
            try:
                self._refresh()
            except Exception as exc:  # a shard away: the streams resync on their own; try again next time
                logger.debug("prefix index refresh: %r", exc)

    def _refresh(self) -> None:
        """Pools, their shards and free blocks; a stream per shard; a resync where a pool moved onto a
        shard or started a new epoch (its blocks changed without events on the stream)."""
        stats = self.client.get_stats()
        shard_map = self.client.shard_map()
        pools = dict(shard_map.pools) if shard_map.sharded else {p: "" for p in stats.pools}
        with self._lock:
            for pool_id, shard_id in pools.items():
                old_shard, old = self._pool_shard.get(pool_id), self._stats.get(pool_id)
                moved = old_shard is not None and old_shard != shard_id
                new_epoch = old is not None and pool_id in stats.pools and old.epoch != stats.pools[pool_id].epoch
                if (moved or new_epoch) and shard_id in self._shards:
                    shard = self._shards[shard_id]
                    shard.restart, shard.synced, shard.broken = True, False, False  # RPCs answer until the resync
            self._pool_shard = {p: s for p, s in pools.items() if p in stats.pools}
            # A pool is gone only if it was known and is no longer listed; one registered after `stats` was
            # read keeps what its events already brought.
            gone = (set(self._stats) - set(stats.pools)) & set(self._hashes)
            self._stats = dict(stats.pools)
            self._external = list(stats.external_pools)
            self._block_size = stats.hash_block_size or self._block_size
            for pool_id in gone:
                del self._hashes[pool_id]
        shard_ids = {s.shard_id for s in shard_map.shards} if shard_map.sharded else {""}
        for shard_id in shard_ids - set(self._shards):
            shard = _Shard(shard_id)
            with self._lock:
                self._shards[shard_id] = shard
            t = threading.Thread(target=self._follow, args=(shard,), name=f"prefix-index-{shard_id or 'main'}",
                                 daemon=True)
            t.start()
            self._threads.append(t)
        for shard in self._shards.values():
            if shard.restart and shard.stream is not None:
                shard.stream.cancel()

    def _follow(self, shard: _Shard) -> None:
        delay = 0.05
        while not self._closed.is_set():
            shard.synced, shard.restart = False, False
            try:
                shard.stream = self.client.open_events(shard_id=shard.shard_id or None, include_state=True)
                self._apply(shard, shard.stream)
                delay = 0.05
            except Exception as exc:  # the shard went away (a failover) or fell behind: resync
                logger.debug("prefix index: shard %r stream ended: %r", shard.shard_id, exc)
                shard.broken = (shard.synced or shard.broken) and not shard.restart  # (it had the hashes)
            shard.synced = False
            if self._closed.is_set():
                return
            if not shard.restart:
                self._closed.wait(delay)
                delay = min(delay * 2, 1.0)
                self.client.refresh_shard_map()  # a failed-over shard is reached at its new leader
            shard.resyncs += 1

    def _apply(self, shard: _Shard, stream: EventStream) -> None:
        rebuilt: dict[str, dict[bytes, int]] = {}
        for e in stream:
            if not shard.synced:  # the dump: each pool's state, then "synced"
                if e.kind == "cleared":
                    rebuilt[e.pool_id] = {}
                elif e.kind == "stored" and e.group_idx == 0:
                    _add(rebuilt.setdefault(e.pool_id, {}), e.block_hashes)
                elif e.kind == "synced":
                    with self._lock:
                        self._hashes.update(rebuilt)
                        shard.applied_sequence = e.sequence
                        shard.synced, shard.broken = True, False
                    rebuilt = {}
                continue
            with self._lock:
                if self._pool_shard.get(e.pool_id, shard.shard_id) == shard.shard_id:
                    held = self._hashes.setdefault(e.pool_id, {})
                    if e.kind == "stored" and e.group_idx == 0:
                        _add(held, e.block_hashes)
                    elif e.kind == "removed" and e.group_idx == 0:
                        for h in e.block_hashes:
                            n = held.get(h, 0)
                            if n > 1:
                                held[h] = n - 1
                            else:
                                held.pop(h, None)
                    elif e.kind == "cleared":
                        held.clear()
                shard.applied_sequence = e.sequence


def _add(held: dict[bytes, int], hashes: list[bytes]) -> None:
    for h in hashes:
        held[h] = held.get(h, 0) + 1
