"""`kvservice serve`: assembles the allocator, servicer, auth, health, reflection, metrics and leases."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import os
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.commands import RegisterExternalPool
from kvservice.errors import KVServiceError
from kvservice.external.metrics import ExternalCollector
from kvservice.external.spec import SpecError, parse_flag
from kvservice.external.subscriber import Feeds
from kvservice.launch import READY_PREFIX
from kvservice.server.auth import Authenticator, AuthInterceptor, load_token_file
from kvservice.server.metrics import LeaderOnly, Metrics
from kvservice.server.servicer import AllocatorServicer, freeze_long_lived, method_handlers
from kvservice.server.startup import (
    DataDirLock,
    StartupError,
    check_config,
    check_port_free,
    is_loopback,
    token_file_for,
)
from kvservice.settings import ServerSettings
from kvservice.store.base import Journal, PersistenceState

logger = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Allocator"].full_name
PERSISTENCE_HEALTH = SERVICE_NAME + ".persistence"  # NOT_SERVING while degraded


class AllocatorServer:
    """The running service; `await start()`, then `await wait()` or `await stop()`."""

    def __init__(self, config: ServerSettings, allocator: Allocator | None = None,
                 journal: Journal | None = None) -> None:
        self.config = config
        self.allocator = allocator or Allocator(config.allocator)
        tokens = load_token_file(config.token_file) if config.token_file else None
        self.auth = Authenticator(tokens, private=config.private)
        self.journal = journal or Journal()
        self.follower = None  # kvservice.store.follower.Follower while this server is a hot standby
        self.metrics = Metrics(self.allocator, lambda: self.journal, lambda: self.servicer.num_watchers,
                               lambda: self.follower)
        self.servicer = AllocatorServicer(self.allocator, self.auth, self.metrics, self.journal)
        self.metrics.registry.register(LeaderOnly(ExternalCollector(self.allocator, lambda: self.servicer.feeds),
                                                  self.metrics.standby))
        self.journal.write_observer = self.metrics.redis_write.observe
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._lease_task: asyncio.Task | None = None
        self.embedded = None  # EmbeddedRedis, when this server started its own
        self.stopped = asyncio.Event()
        self.exit_code = 0
        self.stop_reason = ""  # why it stopped, logged on the way out (a signal, fencing)
        self.feeds: Feeds | None = None  # external pools' subscriptions (start_external)
        self._persistence_health: PersistenceState | None = None

    async def start(self) -> int:
        cfg = self.config
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        reject = lambda method, reason: self.metrics.rejected.labels(method.rsplit("/", 1)[-1], reason).inc()
        interceptor = AuthInterceptor(self.auth, reject)
        self.server = grpc.aio.server(interceptors=[interceptor] if self.auth.enabled else [], options=options)
        self.server.add_generic_rpc_handlers((method_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert or cfg.tls_key:
            if not (cfg.tls_cert and cfg.tls_key):
                raise ValueError("TLS needs both --tls-cert and --tls-key")
            ca = Path(cfg.tls_ca).read_bytes() if cfg.tls_ca else None
            creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())],
                                                root_certificates=ca, require_client_auth=ca is not None)
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        await self.server.start()
        if cfg.metrics_port:
            self.metrics.serve(cfg.metrics_port, cfg.host)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._update_persistence_health()
        self._lease_task = asyncio.create_task(self._expire_leases())
        role = "hot standby: following the leader's WAL" if self.servicer.standby else \
            f"persistence {self.journal.state.value}"
        if cfg.persistence and not cfg.redis_url and not self.servicer.standby:
            role += f", data dir {Path(cfg.data_dir).resolve()}"
        logger.info("%s%s:%d (auth %s, TLS %s, %s)", READY_PREFIX, cfg.host, self.port,
                    "on" if self.auth.enabled else "OFF", "on" if cfg.tls_cert else "off", role)
        return self.port

    async def _expire_leases(self) -> None:
        period = min(1.0, self.allocator.settings.session_ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self._update_persistence_health()
                await self.expire_leases_once()
                if self.servicer.sharding is not None and not self.servicer.standby:
                    await self.servicer.sharding.publish_pending()
            except Exception:  # a failed sweep must not stop future sweeps
                logger.exception("lease sweep failed")

    async def _update_persistence_health(self) -> None:
        state = self.journal.state
        if state != self._persistence_health:
            self._persistence_health = state
            status = (health_pb2.HealthCheckResponse.SERVING if state in (PersistenceState.OK, PersistenceState.OFF)
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            await self.health.set(PERSISTENCE_HEALTH, status)

    def lead(self, store) -> None:
        """Makes this server the leader's: mutations are journaled in `store` (whose leadership it holds)."""
        from kvservice.store.journal import PersistentJournal
        cfg = self.config
        journal = PersistentJournal(store, self.allocator, cfg.require_persistence, cfg.snapshot_every,
                                    cfg.snapshot_interval_s, snapshot_mode=cfg.snapshot_mode,
                                    standby_options=cfg.allocator.to_argv())
        journal.on_fenced = self.on_fenced
        journal.write_observer = self.metrics.redis_write.observe
        self.journal = self.servicer.journal = journal

    def on_fenced(self, message: str) -> None:
        """A newer allocator took over: go NOT_SERVING and exit (never serve from memory)."""
        logger.critical("fenced (%s): going NOT_SERVING and exiting", message)
        self.exit_code = 3
        self.stop_reason = f"fenced by a newer allocator ({message})"
        asyncio.get_running_loop().create_task(self._fence_shutdown())

    async def _fence_shutdown(self) -> None:
        await self.set_serving(False)
        self.stopped.set()

    async def expire_leases_once(self) -> list[str]:
        expired = await self.servicer.expire_leases(time.monotonic())
        for session_id in expired:
            logger.warning("lease of session %s lapsed: its requests were freed", session_id)
            self.metrics.lease_expiries.inc()
        return expired

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def start_external(self) -> None:
        """Registers the --vllm-events pools (through the journal, as any mutation; one recovered with the
        same spec is left as it is) and starts a subscription per external pool. After the journal started."""
        for text in self.config.vllm_events or []:
            spec, tenant = parse_flag(text)
            try:
                await self.servicer.register_external(RegisterExternalPool(tenant, spec, admin=True))
            except KVServiceError as exc:  # e.g. its id taken by a kvservice pool or another shard's
                logger.error("--vllm-events %s: not registered: %s", spec.pool_id, exc.message)
        self.feeds = Feeds(lambda: self.allocator.state.external.pools, self.servicer._apply)
        self.servicer.feeds = self.feeds
        self.feeds.sync()

    async def stop(self, grace: float = 1.0) -> None:
        if self.feeds is not None:
            await self.feeds.stop()
        if self._lease_task is not None:
            self._lease_task.cancel()
        if self.server is not None:
            await self.server.stop(grace)
        await self.journal.stop()
        if self.embedded is not None:
            self.embedded.stop()

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


async def build_server(config: ServerSettings) -> AllocatorServer:
    """The allocator with its state recovered from Redis (unless persistence is off)."""
    allocator = Allocator(config.allocator)
    if not config.persistence:
        logger.warning("persistence is OFF (--no-persistence): a restart loses every allocation")
        return AllocatorServer(config, allocator)
    from kvservice.store.recovery import recover
    store, embedded, url = await connect_store(config)
    try:
        if config.reset_state:
            logger.warning("--reset-state: deleting the allocator state in Redis namespace %r", config.store_namespace)
            await store.reset()
        epoch = await store.acquire_leadership()
        snapshot, covered, entries = await store.load()
        info = recover(allocator, snapshot, entries)
        logger.info("recovered as leader epoch %d: snapshot %d bytes (WAL id %s) + %d WAL entries in %.3f s",
                    epoch, info["snapshot_bytes"], covered, info["replayed"], info["seconds"])
    except BaseException:
        if embedded is not None:
            embedded.stop()
        raise
    freeze_long_lived()
    server = AllocatorServer(config, allocator)
    server.embedded = embedded
    attach_sharding(server, url)
    server.lead(store)
    return server


async def connect_store(config: ServerSettings):
    """(RedisStore, the embedded Redis started for it or None, its URL), once Redis answers."""
    from kvservice.store.redis_store import RedisStore
    embedded = None
    url = config.redis_url
    if not url:
        from kvservice.store.embedded import EmbeddedRedis
        embedded = EmbeddedRedis(config.data_dir, config.redis_fsync)
        url = embedded.start()
    try:
        store = RedisStore(url, config.store_namespace)
        store.lease_ms = int(config.leader_lease_s * 1000)
        deadline = time.monotonic() + config.redis_wait_s
        while True:
            try:
                await store.ping()
                return store, embedded, url
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"Redis at {url} did not answer within {config.redis_wait_s} s ({exc!r}); "
                                          f"start it, fix --redis-url, or run with --no-persistence") from None
                await asyncio.sleep(0.5)
    except BaseException:
        if embedded is not None:
            embedded.stop()
        raise


def attach_sharding(server: AllocatorServer, url: str) -> None:
    config = server.config
    if config.shard_id:
        from kvservice.server.sharding import ShardRouter
        from kvservice.shards.shardmap import ShardMapStore
        server.servicer.sharding = ShardRouter(ShardMapStore(url, config.redis_namespace), config.shard_id)


async def _serve_standby(config: ServerSettings, ready_line: bool) -> tuple[int, str]:
    """A hot standby: follows the leader's WAL, answers only GetShardMap (and health: NOT_SERVING), and takes
    over (a new epoch, the old leader fenced) once the leader's lease has lapsed for a whole lease."""
    from kvservice.store.follower import Follower
    store, _, url = await connect_store(config)
    follower = Follower(store, config.allocator)
    await follower.load()
    server = AllocatorServer(config, follower.allocator)
    server.follower = follower
    attach_sharding(server, url)
    who = f"shard {config.shard_id}" if config.shard_id else "the allocator"
    server.servicer.standby = (f"this is the hot standby of {who} (Redis namespace {config.store_namespace}); it "
                               f"serves once the leader's lease lapses: retry, or ask GetShardMap for the leader")
    try:
        stop_on_signals(server)  # before the ready line: a signal right after it must stop it in order, and log
        port = await server.start()
        await server.set_serving(False)
        if ready_line:
            print(f"{READY_PREFIX}{config.host}:{port}", flush=True)
        stopping = asyncio.create_task(server.stopped.wait())
        while True:
            following = asyncio.create_task(follower.follow_until_lapse(config.leader_lease_s))
            await asyncio.wait([following, stopping], return_when=asyncio.FIRST_COMPLETED)
            if server.stopped.is_set():
                following.cancel()
                return server.exit_code, server.stop_reason or "stopped"
            started = time.monotonic()
            epoch = await store.take_over()
            if epoch:
                break
        await follower.catch_up()  # what the old leader wrote before it was fenced
        if not follower.consistent:
            await follower.load()  # a resync it never finished: recover as a restart would
        freeze_long_lived()
        server.lead(store)
        server.servicer.standby = ""
        server.follower = None
        server.journal.start()
        await server.set_serving(True)
        await server.start_external()  # the old leader's external pools (and --vllm-events): subscribe now
        if server.servicer.sharding is not None:
            await server.servicer.sharding.announce(advertised_address(config, port), epoch)
        logger.warning("took over as leader epoch %d, %.3f s after the lease lapsed (%d WAL entries followed)",
                       epoch, time.monotonic() - started, follower.applied)
        await server.stopped.wait()
    finally:
        await server.stop()
        await store.close()
    return server.exit_code, server.stop_reason or "stopped"


def advertised_address(config: ServerSettings, port: int) -> str:
    """Where clients reach this shard: --advertise (a port of 0 there: the bound one), else --host's address
    and the bound port."""
    if not config.advertise:
        return f"{advertised_host(config.host)}:{port}"
    host, _, advertised_port = config.advertise.rpartition(":")
    return f"{host}:{port}" if advertised_port == "0" else config.advertise


def advertised_host(host: str) -> str:
    """The address other processes reach a server bound to `host` at."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        import socket
        return socket.gethostbyname(socket.gethostname())
    return host


# A Step allocates thousands of container objects (decoded ops, results, events) that reference counting
# frees right after the reply. At CPython's default gen-0 threshold (700) the cyclic collector runs several
# times inside every admission, each time walking the step's objects still in flight: ~10% of the step.
# Every 10,000 instead, most of them are gone by then: ~30x fewer collections of ~1.5 ms each, half the
# collector's time in rpc_bench (the pools themselves are frozen out of its reach: freeze_long_lived).
GC_THRESHOLDS = (10_000, 10, 10)


def preflight(config: ServerSettings) -> DataDirLock | None:
    """What `serve` checks before starting anything (kvservice.server.startup); raises StartupError. Returns
    the data dir's lock when this allocator uses the directory (its embedded Redis, a generated token)."""
    for text in config.vllm_events or []:
        try:
            parse_flag(text)
        except SpecError as exc:
            raise ValueError(f"--vllm-events: {exc}") from None
    check_config(config)
    generates_token = not config.token_file and not is_loopback(config.host) and not config.insecure
    if config.shard_id and not (config.persistence and config.redis_url):
        raise StartupError(f"--shard {config.shard_id} needs --redis-url: every shard reads the shard map and writes "
                           f"its state in the same Redis (or Redis Cluster)")
    if config.standby and not (config.persistence and config.redis_url):
        raise StartupError("--standby needs --redis-url: it follows the leader's WAL in a Redis both reach")
    lock = None
    if (config.persistence and not config.redis_url and not config.standby) or generates_token:
        lock = DataDirLock(config.data_dir).acquire()
    try:
        check_port_free(config.host, config.port)
        config.token_file = token_file_for(config)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


async def serve(config: ServerSettings, ready_line: bool = True) -> int:
    """Runs until SIGINT/SIGTERM (exit 0) or until fenced by a newer allocator (exit 3)."""
    gc.set_threshold(*GC_THRESHOLDS)
    faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT, ...) leaves the stacks in the log
    lock = preflight(config)
    code, reason = 1, "an error (its traceback follows)"
    try:
        code, reason = await _serve(config, ready_line)
        return code
    except asyncio.CancelledError:
        reason = "cancelled"
        raise
    finally:
        if lock is not None:
            lock.release()
        logger.warning("kvservice serve (pid %d) exits with code %d: %s", os.getpid(), code, reason)


# Signals that end the server, each logged with its name: a server must never vanish without a word (only
# SIGKILL is beyond its reach; whoever started it sees -9 as its exit status).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def stop_on_signals(server: AllocatorServer) -> None:
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        if not server.stop_reason:
            server.stop_reason = f"received {sig.name}"
        logger.warning("kvservice serve (pid %d): %s; stopping", os.getpid(), sig.name)
        server.stopped.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop, sig)


async def _serve(config: ServerSettings, ready_line: bool) -> tuple[int, str]:
    if config.standby:
        return await _serve_standby(config, ready_line)
    server = await build_server(config)
    try:
        stop_on_signals(server)  # before the ready line: a signal right after it must stop it in order, and log
        port = await server.start()
        server.journal.start()
        if server.servicer.sharding is not None:
            await server.servicer.sharding.announce(advertised_address(config, port), server.journal.leader_epoch)
        await server.start_external()
        if ready_line:
            print(f"{READY_PREFIX}{config.host}:{port}", flush=True)
        await server.stopped.wait()
    finally:
        await server.stop()
    return server.exit_code, server.stop_reason or "stopped"
