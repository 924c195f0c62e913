"""`kvservice shards list | rebalance | move`: the shard map, and moving pools between shards without losing a
block. A move is three idempotent phases, each a command journaled on its shard: FREEZE on the source (the
pool's calls get UNAVAILABLE, which clients retry; its export goes into Redis), IMPORT on the destination
(installs it, then takes it over in the shard map), DROP on the source. A failed IMPORT is undone by THAW;
a move interrupted anywhere can simply be run again: `finish()` (which `rebalance` and `shards move` run first)
completes a pool left frozen on its shard and drops a copy left on a shard the map no longer gives it to."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.client import KVServiceClient
from kvservice.errors import NotFound
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
        self.finished: list[str] = []  # what finish() completed, for the operator

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
            # The import may have taken over before its reply was lost (the destination died just after):
            # then the move is done but for the DROP. Thawing would fail (the source is no longer the map's).
            if dict(self.client.shard_map().pools).get(pool_id) != to_shard:
                self._call(addresses[from_shard], pb.MovePoolRequest(pool_id=pool_id, phase=Phase.THAW))
                with contextlib.suppress(Exception):  # a copy the import installed (finish() drops it later)
                    self._call(addresses[to_shard], pb.MovePoolRequest(pool_id=pool_id, phase=Phase.DROP))
                raise
        self._call(addresses[from_shard], pb.MovePoolRequest(pool_id=pool_id, phase=Phase.DROP))
        return MoveResult(pool_id, from_shard, to_shard, frozen.num_requests, frozen.export_bytes,
                          time.perf_counter() - start)

    def finish(self) -> list[str]:
        """Completes what interrupted moves left (a crash of either side, or of the rebalancer, between or in
        its phases): a pool frozen on the shard that serves it is moved on to where it was going; a copy on a
        shard the map no longer gives the pool to is dropped there, once the map's shard holds the pool.
        Every shard must answer. Returns what it did."""
        shard_map = self.client.shard_map()
        addresses = {s.shard_id: s.address for s in shard_map.shards}
        held = {shard: self._pools(address) for shard, address in addresses.items()}
        done = []
        for shard, pools in sorted(held.items()):
            for pool_id, stats in sorted(pools.items()):
                owner = shard_map.pools.get(pool_id)
                if owner is None:
                    continue
                if owner != shard:
                    if pool_id in held.get(owner, {}):
                        self._call(addresses[shard], pb.MovePoolRequest(pool_id=pool_id, phase=Phase.DROP))
                        done.append(f"dropped the copy of {pool_id} left on {shard} (served by {owner})")
                    else:  # the map's shard lost its import (it crashed with Redis away): this is the copy
                        self.move(pool_id, shard, owner, addresses)
                        done.append(f"moved {pool_id} again: {shard} -> {owner}, which had lost it")
                elif stats.moving_to:
                    self.move(pool_id, shard, stats.moving_to, addresses)
                    done.append(f"finished moving {pool_id}: {shard} -> {stats.moving_to}")
        self.finished += done
        return done

    def _pools(self, address: str) -> dict[str, pb.PoolStats]:
        channel = self.client.shards.make_channel(address)
        try:
            stub = self.client.stub.__class__(channel)
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=30, metadata=self.client.metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            channel.close()
        return {p.pool_id: p for p in stats.pools}

    def move_to(self, pool_id: str, to_shard: str) -> MoveResult | None:
        """`kvservice shards move`: finishes interrupted moves, then moves the pool (None: it is there)."""
        self.finish()
        shard_map = self.client.shard_map()
        src = dict(shard_map.pools).get(pool_id)
        if src is None:
            raise NotFound(f"no pool {pool_id!r} in the shard map")
        if src == to_shard:
            return None
        return self.move(pool_id, src, to_shard, {s.shard_id: s.address for s in shard_map.shards})

    def rebalance(self, dry_run: bool = False) -> list[MoveResult | tuple[str, str, str]]:
        if not dry_run:
            self.finish()
        shard_map = self.client.shard_map()
        addresses = {s.shard_id: s.address for s in shard_map.shards}
        moves = plan(shard_map)
        if dry_run:
            return moves
        return [self.move(pool_id, src, dst, addresses) for pool_id, src, dst in moves]
