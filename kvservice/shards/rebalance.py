"""`kvservice shards list | rebalance | move`: the shard map, and moving pools between shards without losing a
block. A move is three idempotent phases, each a command journaled on its shard: FREEZE on the source (the
pool's calls get UNAVAILABLE, which clients retry; its export goes into Redis), IMPORT on the destination
(installs it, then takes it over in the shard map), DROP on the source. A failed IMPORT is undone by THAW;
a move interrupted anywhere can simply be run again."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.client import KVServiceClient
from kvservice.wire.status import from_rpc_error

Phase = pb.MovePoolRequest.Phase


@dataclass(slots=True)
class MoveResult:
    pool_id: str
    from_shard: str
    to_shard: str
    num_requests: int
    export_bytes: int
    seconds: float


def plan(shard_map: pb.ShardMapResponse) -> list[tuple[str, str, str]]:
    """(pool, from, to) moves that even out pools per shard (at most one apart), fewest moves first."""
    shards = sorted(s.shard_id for s in shard_map.shards)
    if len(shards) < 2:
        return []
    by_shard: dict[str, list[str]] = {s: [] for s in shards}
    for pool_id, shard in sorted(shard_map.pools.items()):
        by_shard.setdefault(shard, []).append(pool_id)
    moves = []
    while True:
        counts = Counter({s: len(p) for s, p in by_shard.items()})
        heavy = max(shards, key=lambda s: (counts[s], s))
        light = min(shards, key=lambda s: (counts[s], s))
        if counts[heavy] - counts[light] <= 1:
            return moves
        pool_id = by_shard[heavy].pop()
        by_shard[light].append(pool_id)
        moves.append((pool_id, heavy, light))


class Rebalancer:
    def __init__(self, client: KVServiceClient) -> None:
        self.client = client

    def _call(self, address: str, request: pb.MovePoolRequest) -> pb.MovePoolResponse:
        channel = self.client.shards.make_channel(address)
        try:
            stub = self.client.stub.__class__(channel)
            return stub.MovePool(request, timeout=120, metadata=self.client.metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            channel.close()

    def move(self, pool_id: str, from_shard: str, to_shard: str, addresses: dict[str, str]) -> MoveResult:
        start = time.perf_counter()
        frozen = self._call(addresses[from_shard], pb.MovePoolRequest(pool_id=pool_id, phase=Phase.FREEZE,
                                                                      to_shard=to_shard))
        try:
            self._call(addresses[to_shard], pb.MovePoolRequest(pool_id=pool_id, phase=Phase.IMPORT,
                                                               from_shard=from_shard))
        except Exception:
            self._call(addresses[from_shard], pb.MovePoolRequest(pool_id=pool_id, phase=Phase.THAW))
            raise
        self._call(addresses[from_shard], pb.MovePoolRequest(pool_id=pool_id, phase=Phase.DROP))
        return MoveResult(pool_id, from_shard, to_shard, frozen.num_requests, frozen.export_bytes,
                          time.perf_counter() - start)

    def rebalance(self, dry_run: bool = False) -> list[MoveResult | tuple[str, str, str]]:
        shard_map = self.client.shard_map()
        addresses = {s.shard_id: s.address for s in shard_map.shards}
        moves = plan(shard_map)
        if dry_run:
            return moves
        return [self.move(pool_id, src, dst, addresses) for pool_id, src, dst in moves]
