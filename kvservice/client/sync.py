"""The blocking client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import grpc

from kvservice._proto import allocator_pb2 as pb
from kvservice.client.base import (
    FAILOVER_POLL_S,
    FAILOVER_RETRY_S,
    MAX_HOPS,
    RETRYABLE,
    Call,
    ClientBase,
)
from kvservice.client.routing import Conn, ConnectionReplaced, make_stub, replaced_under
from kvservice.client.streams import EventStream
from kvservice.errors import DeadlineExceeded, KVServiceError, Moved, NotFound, Unavailable
from kvservice.results import Event
from kvservice.wire.status import from_rpc_error


class KVServiceClient(ClientBase):
    """Blocking client. One session per client; not for concurrent use from several threads (its lease
    renewal runs in a thread of its own)."""

    def __init__(self, target: str = "127.0.0.1:50051", token: str | None = None, *, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, **options) -> None:
        """Connects to `target`: an allocator's host:port, any shard of a sharded one, or several comma-separated
        addresses (an allocator and its standbys).

        Args:
            token: the bearer token, a line of the server's --token-file (None: the server has no auth).
            tls_ca: the CA (PEM file) that signed the server's certificate: turns TLS on (the server runs with
                --tls-cert/--tls-key).
            tls_cert, tls_key: this client's certificate and private key (PEM files), for a server that
                verifies clients (its --tls-ca: mutual TLS).
            options: client_name, timeout_s (10), retries (4), hash_seed and hash_block_size (the server's, to
                hash prompts here), max_message_bytes (64 MiB), heartbeat (renew the lease in the background;
                True), failover_timeout_s (15), fan_out_grace_s (0.5, sharded Lookups).
        """
        self._setup(grpc, target, token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, **options)
        self._closed = threading.Event()
        self._map_lock = threading.Lock()  # the map changes from any thread (a PrefixIndex's, the lease's)
        self._renewer: threading.Thread | None = None
        self._refreshing = threading.Lock()  # one background map refresh at a time

    def __enter__(self) -> KVServiceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        for channel in self.shards.channels():
            channel.close()

    # ---- calls ---------------------------------------------------------------------------------
    def _call(self, conn: Conn, method: str, request, timeout_s: float | None = None, retries: int | None = None,
              stub=None):
        """`stub`: the connection's stub when the caller checked its session there (default: now). Should a
        map refresh swap it for a new leader's meanwhile, nothing is sent before the session is resumed."""
        delay = 0.05
        retries = self.retries if retries is None else retries
        attempt = 0
        first = stub or conn.stub
        while True:
            stub = conn.stub
            if stub is not first and conn.stale:
                raise ConnectionReplaced()
            try:
                return getattr(stub, method)(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            except (grpc.RpcError, ValueError) as err:
                if replaced_under(conn, stub, err):
                    continue  # on the new channel (the check above stops it if the session must resume first)
                if not isinstance(err, grpc.RpcError) or err.code() not in RETRYABLE or attempt == retries:
                    raise
            attempt += 1
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _run_on(self, conn: Conn, call: Call):
        try:
            if not call.mutating:
                result = call.decode(self._call(conn, call.method, call.request))
                if call.method == "OpenSession":
                    self._renew_in_background()
                return result
            for resent in (False, True):
                stub = conn.stub
                if not conn.attached or conn.stale:
                    self._run_on(conn, self._session_call(conn))
                    stub = conn.stub
                self._stamp(conn, self.session_id, call.request)
                try:
                    reply = self._call(conn, call.method, call.request, stub=stub)
                except grpc.RpcError as err:
                    if not resent and self._out_of_order(conn, err):
                        continue  # refused: sent again once the session knows where it stands
                    self._unacked(conn, err, call.request, call.pool_id)
                    raise
                except BaseException as exc:  # e.g. ConnectionReplaced after a send that timed out
                    self._unacked(conn, exc, call.request, call.pool_id)
                    raise
                self._acked(conn, call.request)
                return call.decode(reply)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _run(self, call: Call):
        shards = self.shards
        if not shards.known and call.method != "GetShardMap":
            self._first_map()
        if call.locate and shards.unplaced(call.locate):
            self.shard_stats(missing_ok=True)  # where the external pools among them live
        if call.merge is not None and call.partial and call.always_merge and not shards.sharded and call.conn is None:
            value = self._run(replace(call, merge=None, partial=False, always_merge=False))
            return self._merge(call, [(shards.seed, value)])  # one allocator: its retries and failover
        if call.merge is not None and (shards.sharded or call.always_merge) and call.conn is None:
            outcomes = self._fan_out(call)
            if call.partial and all(isinstance(value, KVServiceError) for _, value in outcomes):
                # No shard answered: there is no partial answer to give, so wait out a failover as any call does.
                outcomes = self._fan_out(replace(call, partial=False))
            return self._merge(call, outcomes)
        hops, deadline = 0, None
        while True:
            conn = call.conn or (shards.conn_for_mutation(call.pool_id) if call.mutating
                                 else shards.conn_for(call.pool_id))
            stub = conn.stub
            try:
                return self._run_on(conn, call)
            except Moved as exc:
                if call.mutating:
                    self._redirected(conn, call.pool_id)
                hops += 1
                if hops > MAX_HOPS or call.conn is not None:
                    raise
                with self._map_lock:
                    retired = shards.moved(exc.pool_id, exc.shard_id, exc.address)
                self._close(retired)
            except Unavailable as exc:
                if conn.stub is not stub:
                    continue  # the map named the shard's new leader meanwhile: go there now
                # A shard's leader may have failed over: ask the others (or the next address) where it is now.
                deadline = deadline or time.monotonic() + self.failover_timeout_s
                # (A pinned call may too: its connection is the shard's, whatever address the shard moves to.)
                if not self._may_fail_over(exc) or not self._failed_over(conn, deadline):
                    raise

    def _fan_out(self, call: Call) -> list[tuple[Conn, Any]]:
        """`call` on every shard: (shard, result) each. A read goes to all of them at once (one round trip,
        not one per shard); a part that fails is run again on its own, through the retries and failover of
        `_run`, unless the call is partial: then its error is its result (and the map is read again in the
        background, so that the next call finds a failed-over shard's new leader)."""
        parts = [(conn, call.per_shard(conn) if call.per_shard is not None else call.request)
                 for conn in self.shards.all()]
        parts = [(conn, request) for conn, request in parts if request is not None]
        if call.mutating:
            return [(conn, self._run(Call(call.method, request, call.decode, conn=conn))) for conn, request in parts]
        futures = [self._send(conn, call.method, request) for conn, request in parts]
        if call.partial:
            return [(conn, self._partial_part(call, conn, request, future))
                    for (conn, request), future in zip(parts, self._await_partial(call.method, parts, futures))]
        out = []
        for (conn, request), future in zip(parts, futures):
            try:
                if future is None:
                    raise ConnectionReplaced()
                out.append((conn, call.decode(future.result())))
            except grpc.RpcError:
                out.append((conn, self._run(Call(call.method, request, call.decode, conn=conn))))
        return out

    def _send(self, conn: Conn, method: str, request):
        try:
            return getattr(conn.stub, method).future(request, timeout=self.timeout_s, metadata=self.metadata)
        except ValueError:  # its channel was closed just now (a new leader): the caller retries on the new one
            return None

    def _await_partial(self, method: str, parts: list, futures: list) -> list:
        """Waits for the futures until each is done, or `fan_out_grace_s` after the latest success (at most
        timeout_s in all). A channel closed under its call (a new leader) gets one resend."""
        futures = [f if f is not None else self._send(conn, method, request)
                   for (conn, request), f in zip(parts, futures)]
        woke, answered = threading.Event(), []

        def done(future) -> None:
            if not future.cancelled() and future.exception() is None:
                answered.append(time.monotonic())
            woke.set()

        live = [f for f in futures if f is not None]
        for f in live:
            f.add_done_callback(done)
        deadline = time.monotonic() + self.timeout_s
        while True:
            woke.clear()
            if all(f.done() for f in live):
                return futures
            limit = min(deadline, max(answered) + self.fan_out_grace_s) if answered else deadline
            if time.monotonic() >= limit:
                return futures
            woke.wait(limit - time.monotonic())

    def _partial_part(self, call: Call, conn: Conn, request, future):
        """A partial fan-out's part: its result, or (the shard down or silent) its error as a value."""
        if future is None or not future.done():
            if future is not None:
                future.cancel()
            self._refresh_later()
            return Unavailable(f"shard {conn.shard_id!r} at {conn.address} did not answer {call.method} within "
                               f"{self.fan_out_grace_s} s of the other shards (fan_out_grace_s)")
        err = future.exception()
        if err is None:
            return call.decode(future.result())
        if err.code() not in RETRYABLE:
            raise from_rpc_error(err) from None  # the shard refused it: that is the answer
        self._refresh_later()
        return from_rpc_error(err)

    def _refresh_later(self) -> None:
        """Reads the map again in a thread of its own (a failed-over shard's new leader for the next call)."""
        if not self._refreshing.acquire(blocking=False):
            return

        def refresh() -> None:
            try:
                if not self._closed.is_set():
                    self.refresh_shard_map()
            except Exception:  # the client was closed meanwhile: nothing to refresh
                pass
            finally:
                self._refreshing.release()

        threading.Thread(target=refresh, name="kvservice-map", daemon=True).start()

    def _first_map(self) -> None:
        """The map from the first seed or, failing it, from any other address of the target."""
        if self._refresh_map(self.shards.seed) or self.shards.known:
            return
        spares = self.shards.spare_seeds()
        try:
            any(self._refresh_map(conn, retries=0) for conn in spares)
        finally:
            self._close(c.channel for c in spares)

    def _refresh_map(self, conn: Conn, retries: int | None = None) -> bool:
        try:
            reply = self._call(conn, "GetShardMap", pb.GetShardMapRequest(), timeout_s=min(self.timeout_s, 5),
                               retries=retries)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # an allocator older than sharding
                self.shards.known = True
            return False
        with self._map_lock:
            retired = self.shards.adopt(reply)
        self._close(retired)
        return True

    def _failed_over(self, dead: Conn, deadline: float) -> bool:
        """Whether the call may be retried after UNAVAILABLE: a standby (the next address) or another shard's
        map names a new leader for `dead`'s shard, before `deadline`."""
        shards = self.shards
        if not shards.sharded:
            if not shards.alternates or time.monotonic() > deadline:
                return False
            with self._map_lock:
                retired = [shards.rotate(dead)]
            self._close(retired)
            time.sleep(0.1)
            return True
        # Sharded: a failed leader's standby (a new address in the map), or a pool being moved (a new shard
        # for it, or frozen for a moment). Ask for the map every FAILOVER_POLL_S until it changes, then
        # retry the call; retry anyway after FAILOVER_RETRY_S (a move that was called off changes nothing).
        seen, retry_at = (shards.version, dead.address), time.monotonic() + FAILOVER_RETRY_S
        while time.monotonic() < min(deadline, retry_at):
            time.sleep(FAILOVER_POLL_S)
            # The other shards, then the target's spare addresses (e.g. a single shard's standby), then dead.
            spares = shards.spare_seeds()
            try:
                for conn in [c for c in shards.all() if c is not dead] + spares + [dead]:
                    if self._refresh_map(conn, retries=0):
                        break
            finally:
                self._close(c.channel for c in spares)
            if (shards.version, dead.address) != seen:
                return True
        return time.monotonic() < deadline

    @staticmethod
    def _close(channels) -> None:
        for channel in channels:
            channel.close()

    # ---- the lease -----------------------------------------------------------------------------
    def _renew_in_background(self) -> None:
        if not self.heartbeat_enabled or (self._renewer is not None and self._renewer.is_alive()):
            return
        self._renewer = threading.Thread(target=self._renew, name="kvservice-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        """Heartbeats every shard holding the session, every third of the lease, until closed. A shard that
        no longer knows the session (it lapsed anyway) is left alone: the next call there says so. One whose
        leader is gone is looked for at every address known (an idle client's lease must follow a failover
        as its calls would), and renewed there at once."""
        lapsed: set[tuple[str, str]] = set()
        while not self._closed.wait(max(self.ttl_s / 3, 0.05)):
            for conn in self.shards.all():
                if not conn.attached or (conn.shard_id, self.session_id) in lapsed:
                    continue
                try:
                    if not self._heartbeat(conn, lapsed):
                        self._find_leader(conn)
                        self._heartbeat(conn, lapsed)
                except ValueError:  # the channel was closed under it
                    if self._closed.is_set():
                        return

    def _heartbeat(self, conn: Conn, lapsed: set) -> bool:
        """False if the shard's leader did not answer (down, a standby, fenced)."""
        try:
            conn.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id), timeout=self.timeout_s,
                                metadata=self.metadata)
        except grpc.RpcError as err:
            error = from_rpc_error(err)
            if isinstance(error, NotFound):
                lapsed.add((conn.shard_id, self.session_id))
            return not isinstance(error, (Unavailable, DeadlineExceeded))
        return True

    def _find_leader(self, conn: Conn) -> None:
        """Points `conn` at its shard's leader now: from the map (sharded; every address known is asked), or
        the first of an unsharded allocator's other addresses that takes a heartbeat."""
        if self.shards.sharded:
            self.refresh_shard_map()
            return
        for address in list(self.shards.alternates):
            channel = self.shards.make_channel(address)
            try:
                make_stub(channel).Heartbeat(pb.HeartbeatRequest(session_id=self.session_id),
                                             timeout=min(self.timeout_s, 5), metadata=self.metadata)
            except grpc.RpcError as err:
                if not isinstance(from_rpc_error(err), NotFound):
                    continue  # down, or a standby: not the leader
            finally:
                channel.close()
            with self._map_lock:
                retired = [self.shards.switch(conn, address)] if address in self.shards.alternates else []
            self._close(retired)
            return

    def watch_events(self, pool_ids: Sequence[str] = (), start_sequence: int | None = None,
                     timeout_s: float | None = None, *, shard_id: str | None = None,
                     include_state: bool = False) -> Iterator[Event]:
        """Events of `pool_ids` (all of one shard, when sharded; `shard_id`: every pool of that shard), from
        `start_sequence` on. `include_state`: first the pools' cached blocks as they are now (per pool a
        "cleared" event, then "stored" ones), then one "synced" event, then new events."""
        yield from self.open_events(pool_ids, start_sequence, timeout_s, shard_id=shard_id,
                                    include_state=include_state)

    def open_events(self, pool_ids: Sequence[str] = (), start_sequence: int | None = None,
                    timeout_s: float | None = None, *, shard_id: str | None = None,
                    include_state: bool = False) -> EventStream:
        """`watch_events` as a stream another thread can `cancel()`."""
        if not self.shards.known:
            self._refresh_map(self.shards.seed)
        msg = self._watch_request(pool_ids, start_sequence, include_state)
        conn = self._watch_target(pool_ids, shard_id)
        return EventStream(conn.stub.WatchEvents(msg, metadata=self.metadata, timeout=timeout_s))

    def refresh_shard_map(self) -> bool:
        """Reads the shard map again (from any shard, or the target's other addresses); False if none answered."""
        spares = self.shards.spare_seeds()
        try:
            return any(self._refresh_map(conn, retries=0) for conn in [*self.shards.all(), *spares])
        finally:
            self._close(c.channel for c in spares)
