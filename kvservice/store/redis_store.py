"""Redis layout and fenced writes.

Keys under a namespace `ns`:
    ns:epoch             leadership counter (INCR on every allocator start)
    ns:leader            the epoch of the allocator allowed to write
    ns:wal               the write-ahead log (a stream; one entry per mutating batch)
    ns:snapshot          the latest full snapshot (bytes)
    ns:snapshot:wal_id   the WAL id the snapshot covers (entries after it are replayed)
    ns:snapshot:pending:W  a snapshot being written by writer W (renamed into place when complete)
    ns:alive             the leader's lease (its epoch, expiring): a hot standby takes over when it lapses
    ns:snapshot:count    snapshots committed
    ns:snapshot:at       when the last one was committed (Unix seconds, Redis's clock)

Every write goes through a Lua script that first checks `ns:leader` against the writer's epoch, so
an old allocator that lives on after a new one started can never write (fencing). A missing leader key
means Redis lost its data (no AOF, a wiped volume, a failover to an empty replica): the leader takes the
key back, only if it is still absent (`retake_leadership`), and resyncs. Any other epoch in the key (a
newer one, or an older one written after Redis lost ours) fences: an allocator never fights for it.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

CLUSTER_SCHEME = "rediscluster://"  # a Redis Cluster: any node's address (redis-py finds the others)


def is_cluster(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEME)


def connect(url: str, **options) -> aioredis.Redis:
    """An asyncio client for `url`: `redis://`, `rediss://`, `unix://`, or `rediscluster://host:port`."""
    if is_cluster(url):
        return AsyncRedisCluster.from_url("redis://" + url[len(CLUSTER_SCHEME):], **options)
    return aioredis.Redis.from_url(url, **options)


def connect_sync(url: str, **options) -> redis.Redis:
    if is_cluster(url):
        return RedisCluster.from_url("redis://" + url[len(CLUSTER_SCHEME):], **options)
    return redis.Redis.from_url(url, **options)


def hash_tagged(namespace: str) -> str:
    """A namespace whose keys all hash to one Redis Cluster slot (scripts touch several of them at once)."""
    return namespace if namespace.startswith("{") and namespace.endswith("}") else "{" + namespace + "}"

FENCED_PREFIX, LOST_PREFIX = "FENCED", "LEADERLOST"

_CHECK = """
local leader = redis.call('GET', KEYS[1])
if not leader then
  return redis.error_reply('LEADERLOST: the leader key is gone (Redis lost its data); epoch ' .. ARGV[1])
end
if leader ~= ARGV[1] then
  return redis.error_reply('FENCED: this allocator holds epoch ' .. ARGV[1] .. ', the leader is ' .. leader)
end
"""
# Takes the leader key back after Redis lost it, only if it is still absent: 1, else 0 (fenced).
RETAKE = """
if redis.call('GET', KEYS[1]) then return 0 end
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
if counter < tonumber(ARGV[1]) then redis.call('SET', KEYS[2], ARGV[1]) end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""
# A new leader: the next epoch, above any epoch the leader key holds (the counter may have been lost), with
# a fresh lease. With ARGV[2] = 1 only if the lease lapsed (a standby taking over): 0 when it has not.
ACQUIRE = """
if ARGV[2] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local epoch = redis.call('INCR', KEYS[2])
local leader = tonumber(redis.call('GET', KEYS[1]) or '0')
if leader >= epoch then
  epoch = leader + 1
  redis.call('SET', KEYS[2], epoch)
end
redis.call('SET', KEYS[1], epoch)
redis.call('SET', KEYS[3], epoch, 'PX', ARGV[1])
return epoch
"""
# The leader renews its lease, only while it is the leader: 1, else 0.
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1
"""
APPEND = _CHECK + """
local ids = {}
for i = 2, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[2], '*', 'e', ARGV[i]) end
return ids
"""
SET_PENDING = _CHECK + """
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""
COMMIT_SNAPSHOT = _CHECK + """
local function newer(a, b)  -- stream ids 'ms-seq': is a after b?
  if not b then return true end
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end
if not newer(ARGV[2], redis.call('GET', KEYS[4])) then
  redis.call('DEL', KEYS[2])  -- a newer snapshot is already in place
  return -1
end
redis.call('RENAME', KEYS[2], KEYS[3])
redis.call('SET', KEYS[4], ARGV[2])
redis.call('INCR', KEYS[6])
redis.call('SET', KEYS[7], redis.call('TIME')[1])
redis.call('XTRIM', KEYS[5], 'MINID', ARGV[2])
return redis.call('XLEN', KEYS[5])
"""


class FencedError(RuntimeError):
    """Another allocator took over: this one must stop serving."""


class LeaderLostError(RuntimeError):
    """Redis no longer holds this allocator's leader key (it lost its data): take it back and resync."""


def is_fenced(exc: BaseException) -> bool:
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(FENCED_PREFIX)


class RedisStore:
    def __init__(self, url: str, namespace: str = "kvservice", socket_timeout_s: float = 2.0) -> None:
        self.url = url
        self.namespace = namespace
        self.socket_timeout_s = socket_timeout_s
        ns = namespace
        self.k_epoch, self.k_leader, self.k_wal = f"{ns}:epoch", f"{ns}:leader", f"{ns}:wal"
        self.k_snapshot, self.k_snapshot_id = f"{ns}:snapshot", f"{ns}:snapshot:wal_id"
        self.k_snapshot_count, self.k_snapshot_at = f"{ns}:snapshot:count", f"{ns}:snapshot:at"
        self.k_alive = f"{ns}:alive"
        self.lease_ms = 2000
        if is_cluster(url) and hash_tagged(namespace) != namespace:
            raise ValueError(f"namespace {namespace!r} on a Redis Cluster must be hash tagged "
                             f"({hash_tagged(namespace)!r})")
        self.redis = connect(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        self._append = self.redis.register_script(APPEND)
        self._commit = self.redis.register_script(COMMIT_SNAPSHOT)
        self._set_pending = self.redis.register_script(SET_PENDING)
        self._retake = self.redis.register_script(RETAKE)
        self._acquire = self.redis.register_script(ACQUIRE)
        self._renew = self.redis.register_script(RENEW)
        self.epoch = 0

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def acquire_leadership(self) -> int:
        """Takes the leader key with a new epoch: from now on older allocators are fenced."""
        self.epoch = int(await self._acquire(keys=[self.k_leader, self.k_epoch, self.k_alive], args=[self.lease_ms, 0]))
        return self.epoch

    async def take_over(self) -> int:
        """A standby's takeover: leadership with a new epoch, only if the leader's lease lapsed (0: it has not)."""
        epoch = int(await self._acquire(keys=[self.k_leader, self.k_epoch, self.k_alive], args=[self.lease_ms, 1]))
        if epoch:
            self.epoch = epoch
        return epoch

    async def renew_lease(self) -> bool:
        """The leader's heartbeat to its standbys; False: it is not the leader any more."""
        return bool(await self._renew(keys=[self.k_leader, self.k_alive], args=[self.epoch, self.lease_ms]))

    async def lease_held(self) -> bool:
        return bool(await self.redis.exists(self.k_alive))

    async def leader(self) -> int | None:
        """The leader's epoch, or None when the key is gone."""
        value = await self.redis.get(self.k_leader)
        return int(value) if value is not None else None

    async def retake_leadership(self) -> bool:
        """After Redis lost the leader key: takes it back with this allocator's epoch, atomically, if it is still
        absent (False: another allocator wrote it meanwhile, and this one is fenced)."""
        return bool(await self._retake(keys=[self.k_leader, self.k_epoch], args=[self.epoch]))

    async def append(self, entries: list[bytes]) -> list[bytes]:
        """Appends entries in order, in one round trip, if this allocator still leads."""
        return await self._fenced(self._append, [self.k_leader, self.k_wal], [self.epoch, *entries])

    def pending_key(self, writer: str) -> str:
        return f"{self.namespace}:snapshot:pending:{writer}"

    async def write_pending(self, writer: str, data: bytes) -> None:
        await self._fenced(self._set_pending, [self.k_leader, self.pending_key(writer)], [self.epoch, data])

    async def commit_snapshot(self, wal_id: bytes, writer: str = "fork") -> int:
        """Makes `writer`'s pending snapshot current (it covers WAL entries up to `wal_id`) unless a newer
        one is already in place, and trims the WAL behind it. Returns the WAL length left (-1: superseded)."""
        return int(await self._fenced(self._commit, [self.k_leader, self.pending_key(writer), self.k_snapshot,
                                                     self.k_snapshot_id, self.k_wal, self.k_snapshot_count,
                                                     self.k_snapshot_at],
                                      [self.epoch, wal_id]))

    async def snapshots_committed(self) -> int:
        return int(await self.redis.get(self.k_snapshot_count) or 0)

    async def last_snapshot_at(self) -> float:
        """Unix time (Redis's clock) of the last committed snapshot; 0: none."""
        return float(await self.redis.get(self.k_snapshot_at) or 0)

    async def _fenced(self, script, keys, args):
        try:
            return await script(keys=keys, args=args)
        except redis.ResponseError as exc:
            if is_fenced(exc):
                raise FencedError(str(exc)) from None
            if str(exc).startswith(LOST_PREFIX):
                raise LeaderLostError(str(exc)) from None
            raise

    async def load(self, batch: int = 10_000) -> tuple[bytes | None, bytes | None, list[tuple[bytes, bytes]]]:
        """(snapshot, the WAL id it covers, the WAL entries after it as (id, entry)), read atomically with
        respect to snapshot commits (a commit between the two reads would pair the wrong entries)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            snapshot, covered = await pipe.get(self.k_snapshot).get(self.k_snapshot_id).execute()
        start = b"(" + covered if covered else b"-"
        entries: list[tuple[bytes, bytes]] = []
        while True:
            chunk = await self.redis.xrange(self.k_wal, min=start, max="+", count=batch)
            entries.extend((entry_id, fields[b"e"]) for entry_id, fields in chunk)
            if len(chunk) < batch:
                break
            start = b"(" + chunk[-1][0]
        return snapshot, covered, entries

    async def usage(self) -> dict[str, int]:
        """WAL length and snapshot bytes (to check Redis memory stays bounded)."""
        return {"wal_entries": int(await self.redis.xlen(self.k_wal)),
                "snapshot_bytes": int(await self.redis.strlen(self.k_snapshot))}

    async def reset(self) -> None:
        """Deletes this namespace's state (operators only: `kvservice serve --reset-state`)."""
        pending = [k async for k in self.redis.scan_iter(match=f"{self.namespace}:snapshot:pending:*")]
        await self.redis.delete(self.k_wal, self.k_snapshot, self.k_snapshot_id, self.k_snapshot_count,
                                self.k_snapshot_at, *pending)


def write_pending_snapshot_sync(url: str, namespace: str, epoch: int, data: bytes, writer: str = "fork") -> None:
    """Writes a snapshot as pending from a forked child (its own, blocking connection)."""
    client = connect_sync(url, socket_timeout=60)
    try:
        client.eval(SET_PENDING, 2, f"{namespace}:leader", f"{namespace}:snapshot:pending:{writer}", epoch, data)
    finally:
        client.close()
