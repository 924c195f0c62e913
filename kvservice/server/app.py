"""The assembled server: the allocator (recovered from Redis), servicer, auth, health, reflection, metrics,
leases and external feeds. The `kvservice serve` process around it (signals, standby, exit) is serve.py's."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.commands import RegisterExternalPool
from kvservice.errors import KVServiceError
from kvservice.external.feeds import Feeds
from kvservice.external.metrics import ExternalCollector
from kvservice.external.spec import parse_flag
from kvservice.launch import READY_PREFIX
from kvservice.server.auth import Authenticator, AuthInterceptor, load_token_file
from kvservice.server.metrics import LeaderOnly, Metrics
from kvservice.server.servicer import AllocatorServicer, freeze_long_lived, method_handlers
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
    from kvservice.store.recovery import close_gap, recover
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
        if info["skipped_after_gap"]:
            await close_gap(store, allocator)
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
