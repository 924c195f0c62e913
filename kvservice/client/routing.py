"""Which connection a call goes to: one per shard of a sharded allocator (one in all for an unsharded one).

A client has one session id; each shard knows it under that id (the first shard opens it, the others
attach), and each keeps its own sequence numbers: a `Conn` carries a shard's channel, stub and sequence
state. The shard map (GetShardMap) says which shard serves a pool; a redirect (`errors.Moved`) or a
failover (a shard's leader moved) updates it. No RPCs here: the sync and asyncio clients do the calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice._proto import allocator_pb2_grpc as pb_grpc
from kvservice.wire.framing import serialize_step

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Allocator"].full_name


def make_stub(channel) -> pb_grpc.AllocatorStub:
    stub = pb_grpc.AllocatorStub(channel)
    # Step with the op-by-op serializer (see serialize_step): the same bytes, faster for big steps.
    stub.Step = channel.unary_unary(f"/{SERVICE_NAME}/Step", request_serializer=serialize_step,
                                    response_deserializer=pb.StepResponse.FromString)
    return stub


def channel_credentials(tls_ca: str | None, tls_cert: str | None, tls_key: str | None):
    read = lambda p: Path(p).read_bytes() if p else None
    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


def channel_options(max_message_bytes: int = 64 * 1024 * 1024) -> list[tuple[str, int]]:
    """The options of every channel to an allocator.

    `use_local_subchannel_pool`: by default gRPC shares one connection (subchannel) per address among all the
    channels of a process, with its reconnect backoff. A channel to an allocator that stopped keeps backing
    off (up to 2 minutes), and a *new* channel to a new allocator that was given the same port (a restart, or
    port 0 handing out the port again) inherited that state: its first call failed at once with the dead
    server's "Connection refused" although the new one was serving. Each channel now has its own.
    The backoff cap: a client whose allocator restarts reconnects within a second or two, not minutes.
    """
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000)]


def open_channel(address: str) -> grpc.Channel:
    """A plain (insecure) blocking channel with `channel_options()`: for probes and tests."""
    return grpc.insecure_channel(address, channel_options())


class ConnectionReplaced(grpc.RpcError):
    """A call's channel was closed under it: another thread (a map refresh) swapped in the shard's new
    leader. A read is sent again on the new connection; a mutation goes back to `_run`, which resumes the
    session there first."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "this shard's connection was replaced during the call (its leader changed); try again"


def replaced_under(conn: Conn, stub, err: Exception) -> bool:
    """Whether `err` (from a call made with `stub`) came from `conn` being given a new channel meanwhile: grpc
    raises ValueError on a closed channel, and cancels calls in flight when it closes."""
    if conn.stub is stub:
        return False
    if isinstance(err, grpc.RpcError):
        return err.code() == grpc.StatusCode.CANCELLED
    return isinstance(err, ValueError) or type(err).__name__ == "UsageError"  # grpc.aio's closed channel


@dataclass(slots=True)
class Conn:
    """One shard (or the only allocator) as this client sees it."""

    shard_id: str
    address: str
    channel: Any
    stub: pb_grpc.AllocatorStub
    attached: bool = False  # the session is open (or attached) here
    stale: bool = False  # the shard's leader changed (failover): resume before the next mutation
    next_sequence: int = 1
    # A mutation sent but never acknowledged (the reply was lost): its sequence survives a resume, so
    # sending it again (the same body) gets the stored reply instead of applying it twice.
    unacked_sequence: int = 0
    unacked_body: int = 0  # its body's digest (session and sequence aside): what tells a resend from a new call
    unacked_pool: str = ""  # its pool: resent here first even if the pool moved meanwhile (conn_for_mutation)


@dataclass(slots=True)
class Shards:
    make_channel: Callable[[str], Any]
    seed: Conn
    sharded: bool = False
    known: bool = False  # the map was read once
    version: int = 0
    conns: dict[str, Conn] = field(default_factory=dict)  # shard id -> connection
    pools: dict[str, str] = field(default_factory=dict)  # pool id -> shard id
    alternates: list[str] = field(default_factory=list)  # more addresses of an unsharded allocator (standbys)
    # Every address this client may find a leader at: the target's (the first seed too: a leader restarted
    # there after its standby took over), then each one a map or a redirect named. Never forgotten.
    addresses: list[str] = field(default_factory=list)
    external: dict[str, str] = field(default_factory=dict)  # external pool id -> shard id (GetStats says)

    @classmethod
    def start(cls, target: str, make_channel: Callable[[str], Any]) -> Shards:
        """`target`: an address, or several comma-separated (a leader and its standbys; any shard)."""
        addresses = [a.strip() for a in target.split(",") if a.strip()]
        channel = make_channel(addresses[0])
        return cls(make_channel, Conn("", addresses[0], channel, make_stub(channel)), alternates=addresses[1:],
                   addresses=list(dict.fromkeys(addresses)))

    def learn(self, address: str) -> None:
        if address and address not in self.addresses:
            self.addresses.append(address)

    def rotate(self, conn: Conn) -> Any:
        """An unsharded allocator's next address (its standby may lead now); returns the retired channel."""
        return self.switch(conn, self.alternates[0])

    def switch(self, conn: Conn, address: str) -> Any:
        """An unsharded allocator's connection to `address` (one of its alternates, found leading); returns
        the retired channel."""
        self.alternates.remove(address)
        self.alternates.append(conn.address)
        retired = conn.channel
        conn.address = address
        conn.channel = self.make_channel(conn.address)
        conn.stub, conn.stale = make_stub(conn.channel), conn.attached
        return retired

    def conn_for(self, pool_id: str | None) -> Conn:
        if not self.sharded or pool_id is None:
            return self.seed
        shard = self.pools.get(pool_id, self.external.get(pool_id))
        return self.conns.get(shard, self.seed) if shard is not None else self.seed

    def conn_for_mutation(self, pool_id: str | None) -> Conn:
        """`conn_for`, but a pool whose last mutation may have been applied without its reply goes back to that
        shard first: it answers from the stored reply even if the pool has moved since (redirected at once,
        the mutation would be applied a second time on the new shard)."""
        if self.sharded and pool_id is not None:
            for conn in self.conns.values():
                if conn.unacked_sequence and conn.unacked_pool == pool_id:
                    return conn
        return self.conn_for(pool_id)

    def unplaced(self, pool_ids) -> bool:
        """Whether some of `pool_ids` are in neither the map nor the external pools seen (sharded)."""
        return self.sharded and any(p not in self.pools and p not in self.external for p in pool_ids)

    def all(self) -> list[Conn]:
        return list(self.conns.values()) if self.sharded else [self.seed]

    def adopt(self, reply: pb.ShardMapResponse) -> list[Any]:
        """Takes a GetShardMap reply; returns the channels it retired (to be closed by the caller)."""
        self.known = True
        if not reply.sharded:
            self.sharded = False
            return []
        if self.sharded and reply.version < self.version:
            return []  # an older map than the one in hand
        self.sharded, self.version = True, reply.version
        if not self.seed.shard_id:
            self.seed.shard_id = reply.shard_id
            self.conns[reply.shard_id] = self.seed
        retired = []
        for info in reply.shards:
            self.learn(info.address)
            conn = self.conns.get(info.shard_id)
            if conn is None:
                channel = self.make_channel(info.address)
                self.conns[info.shard_id] = Conn(info.shard_id, info.address, channel, make_stub(channel))
            elif conn.address != info.address:  # a failover: the shard's new leader
                retired.append(conn.channel)
                conn.address, conn.channel = info.address, self.make_channel(info.address)
                conn.stub = make_stub(conn.channel)
                conn.stale = conn.attached
        self.pools = dict(reply.pools)
        return retired

    def moved(self, pool_id: str, shard_id: str, address: str) -> list[Any]:
        """A redirect: `pool_id` is served by `shard_id` at `address`."""
        self.learn(address)
        self.pools[pool_id] = shard_id
        conn = self.conns.get(shard_id)
        if conn is None:
            channel = self.make_channel(address)
            self.conns[shard_id] = Conn(shard_id, address, channel, make_stub(channel))
        elif conn.address != address:
            retired = [conn.channel]
            conn.address, conn.channel = address, self.make_channel(address)
            conn.stub, conn.stale = make_stub(conn.channel), conn.attached
            return retired
        return []

    def spare_seeds(self) -> list[Conn]:
        """Fresh connections to every address (the target's, and each one learned) no shard is reached at now:
        a single shard's standby named only in the target, its old leader restarted at the first seed. Whom
        to ask for the map when every known shard is down. The caller closes their channels."""
        used = {c.address for c in self.all()}
        out = []
        for address in list(self.addresses):
            if address not in used:
                channel = self.make_channel(address)
                out.append(Conn("", address, channel, make_stub(channel)))
        return out

    def channels(self) -> list[Any]:
        return [c.channel for c in self.all()]
