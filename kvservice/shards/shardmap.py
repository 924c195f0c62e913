"""The shard map: which shard serves which pool, and where each shard's leader listens. It lives in Redis
(one hash under the deployment's namespace, `{NS}:shards`) and every shard serves it (GetShardMap).

    s:<shard id>  ->  "<epoch> <address>"      the shard's leader (written when it takes leadership)
    p:<pool id>   ->  "<shard id> <tenant>"    set once when the pool is first registered; moved by rebalance
    x:<pool id>   ->  "<shard id> <tenant>"    an external pool (RegisterExternalPool), on the shard it feeds
    v             ->  version, incremented by every change (of s: and p:)

A pool's assignment is decided by whoever registers it first (HSETNX: two shards can never both claim it).
Pool ids are one namespace across both kinds: an id held as one kind is refused as the other.
Beside the map, `{NS}:shards:pins:<pool id>` (a hash: pin key -> "<tokens> <block ids>", and the field
PUBLISHER -> the id of the shard that wrote it) is what the shard serving the pool published of its live
pins, for other shards to check a transfer source against: only what the map's shard published counts.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

from kvservice.store.redis_store import connect, hash_tagged

ANNOUNCE = """
local current = redis.call('HGET', KEYS[1], 's:' .. ARGV[1])
if current then
  local epoch = tonumber(string.match(current, '^(%d+)'))
  if epoch > tonumber(ARGV[2]) then return 0 end
end
redis.call('HSET', KEYS[1], 's:' .. ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
redis.call('HINCRBY', KEYS[1], 'v', 1)
return 1
"""
TAKEN = "!"  # what the assignment scripts answer for an id the other kind of pool holds
ASSIGN = """
if redis.call('HEXISTS', KEYS[1], 'x:' .. ARGV[1]) == 1 then return '!' end
if redis.call('HSETNX', KEYS[1], 'p:' .. ARGV[1], ARGV[2] .. ' ' .. ARGV[3]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'v', 1)
end
return redis.call('HGET', KEYS[1], 'p:' .. ARGV[1])
"""
ASSIGN_EXTERNAL = """
if redis.call('HEXISTS', KEYS[1], 'p:' .. ARGV[1]) == 1 then return '!' end
redis.call('HSETNX', KEYS[1], 'x:' .. ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
return redis.call('HGET', KEYS[1], 'x:' .. ARGV[1])
"""
RELEASE_EXTERNAL = """
local current = redis.call('HGET', KEYS[1], 'x:' .. ARGV[1])
if current and string.match(current, '^(%S+)') == ARGV[2] then redis.call('HDEL', KEYS[1], 'x:' .. ARGV[1]) end
return 1
"""
PUBLISHER = "\x1f"  # the pins hash's field naming the shard that published it (no pin key is a control character)
PUBLISH_PINS = """
local owner = redis.call('HGET', KEYS[2], 'p:' .. ARGV[1])
if not owner or string.match(owner, '^(%S+)') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], ARGV[3], ARGV[2])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
MOVE = """
local current = redis.call('HGET', KEYS[1], 'p:' .. ARGV[1])
if not current or string.match(current, '^(%S+)') ~= ARGV[2] then return 0 end
local export = redis.call('GET', KEYS[2])
if not export or redis.sha1hex(export) ~= ARGV[4] then return 0 end
redis.call('HSET', KEYS[1], 'p:' .. ARGV[1], ARGV[3] .. ' ' .. string.match(current, '^%S+ ?(.*)$'))
redis.call('HINCRBY', KEYS[1], 'v', 1)
return 1
"""


@dataclass(slots=True)
class ShardInfo:
    shard_id: str
    address: str
    epoch: int


@dataclass(slots=True)
class ShardMap:
    version: int = 0
    shards: dict[str, ShardInfo] = field(default_factory=dict)
    pools: dict[str, tuple[str, str]] = field(default_factory=dict)  # pool id -> (shard id, owner tenant)

    def shard_of(self, pool_id: str) -> str | None:
        entry = self.pools.get(pool_id)
        return entry[0] if entry is not None else None

    def pool_counts(self) -> Counter:
        return Counter(shard for shard, _ in self.pools.values())

    def least_loaded(self) -> str:
        """The shard with the fewest pools (ties: the smallest id)."""
        counts = self.pool_counts()
        return min(self.shards, key=lambda s: (counts[s], s))


class ShardMapStore:
    def __init__(self, url: str, namespace: str, socket_timeout_s: float = 2.0) -> None:
        self.key = f"{hash_tagged(namespace)}:shards"
        self.redis = connect(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        self._announce = self.redis.register_script(ANNOUNCE)
        self._assign = self.redis.register_script(ASSIGN)
        self._move = self.redis.register_script(MOVE)
        self._assign_external = self.redis.register_script(ASSIGN_EXTERNAL)
        self._release_external = self.redis.register_script(RELEASE_EXTERNAL)
        self._publish_pins = self.redis.register_script(PUBLISH_PINS)

    async def close(self) -> None:
        await self.redis.aclose()

    async def load(self) -> ShardMap:
        raw = await self.redis.hgetall(self.key)
        out = ShardMap(int(raw.pop(b"v", 0)))
        for k, v in raw.items():
            kind, _, name = k.decode().partition(":")
            value = v.decode()
            if kind == "s":
                epoch, _, address = value.partition(" ")
                out.shards[name] = ShardInfo(name, address, int(epoch))
            elif kind == "p":
                shard, _, tenant = value.partition(" ")
                out.pools[name] = (shard, tenant)
        return out

    async def announce(self, shard_id: str, address: str, epoch: int) -> bool:
        """Records `address` as the shard's leader (unless a newer epoch already did)."""
        return bool(await self._announce(keys=[self.key], args=[shard_id, epoch, address]))

    async def assign(self, pool_id: str, shard_id: str, tenant: str) -> str:
        """Assigns an unassigned pool to `shard_id`; returns the shard that serves it (maybe another), or
        TAKEN when an external pool holds the id."""
        current = await self._assign(keys=[self.key], args=[pool_id, shard_id, tenant])
        return current.decode().partition(" ")[0]

    async def assign_external(self, pool_id: str, shard_id: str, tenant: str) -> tuple[str, str]:
        """Records an external pool's id for `shard_id` unless held; returns (its shard, tenant), or
        (TAKEN, "") when a kvservice pool holds the id."""
        current = (await self._assign_external(keys=[self.key], args=[pool_id, shard_id, tenant])).decode()
        shard, _, owner = current.partition(" ")
        return shard, owner

    async def release_external(self, pool_id: str, shard_id: str) -> None:
        """Frees an external pool's id, if `shard_id` holds it."""
        await self._release_external(keys=[self.key], args=[pool_id, shard_id])

    def pins_key(self, pool_id: str) -> str:
        return f"{self.key}:pins:{pool_id}"

    async def publish_pins(self, pool_id: str, shard_id: str, pins: dict[str, str]) -> bool:
        """Replaces what is published of the pool's live pins (pin key -> "<tokens> <block ids>") with
        `shard_id`'s, only if the map gives the pool to `shard_id` (a copy left on another shard never
        overwrites its owner's). Returns whether it did."""
        args = [pool_id, shard_id, PUBLISHER] + [x for kv in sorted(pins.items()) for x in kv]
        return bool(await self._publish_pins(keys=[self.pins_key(pool_id), self.key], args=args))

    async def pins(self, pool_id: str) -> tuple[str, dict[str, tuple[int, list[int]]]]:
        """(the shard that published them, the pool's published live pins: pin key -> (tokens, block ids))."""
        out, publisher = {}, ""
        for key, value in (await self.redis.hgetall(self.pins_key(pool_id))).items():
            if key.decode() == PUBLISHER:
                publisher = value.decode()
                continue
            tokens, _, blocks = value.decode().partition(" ")
            out[key.decode()] = (int(tokens), [int(b) for b in blocks.split(",") if b])
        return publisher, out

    async def move(self, pool_id: str, from_shard: str, to_shard: str, export: bytes) -> bool:
        """Reassigns the pool, only if `from_shard` serves it and its handoff key still holds `export` (what
        the destination imported): a THAW deletes it first, so an IMPORT that arrives after the move was
        undone (or after a later FREEZE exported anew) takes nothing over."""
        digest = hashlib.sha1(export).hexdigest()
        return bool(await self._move(keys=[self.key, self.handoff_key(pool_id)],
                                     args=[pool_id, from_shard, to_shard, digest]))

    def handoff_key(self, pool_id: str) -> str:
        """Where a moving pool's export waits for its destination."""
        return f"{self.key}:handoff:{pool_id}"

    async def forget_pools(self, pool_ids: list[str]) -> None:
        if pool_ids:
            await self.redis.hdel(self.key, *[f"p:{p}" for p in pool_ids])
            await self.redis.hincrby(self.key, "v", 1)
