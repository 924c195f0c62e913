"""`kvservice serve`: assembles the allocator, servicer, auth, health, reflection, metrics and leases."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.hashing import DEFAULT_HASH_BLOCK_SIZE, DEFAULT_HASH_SEED
from kvservice.server.auth import Authenticator, AuthInterceptor, load_token_file
from kvservice.server.metrics import Metrics
from kvservice.server.servicer import AllocatorServicer, NullJournal, method_handlers

logger = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Allocator"].full_name


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0  # 0: no metrics endpoint
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE
    hash_seed: str = DEFAULT_HASH_SEED
    session_ttl_s: float = 30.0
    event_retention: int = 100_000
    quotas: dict[str, int] = field(default_factory=dict)
    max_message_bytes: int = 64 * 1024 * 1024
    data_dir: str = "./kvservice-data"


class AllocatorServer:
    """The running service; `await start()`, then `await wait()` or `await stop()`."""

    def __init__(self, config: ServerConfig, allocator: Allocator | None = None, journal=None) -> None:
        self.config = config
        self.allocator = allocator or Allocator(config.hash_block_size, config.hash_seed, config.session_ttl_s,
                                                config.event_retention, config.quotas)
        tokens = load_token_file(config.token_file) if config.token_file else None
        self.auth = Authenticator(tokens)
        self.journal = journal or NullJournal()
        self.metrics = Metrics(self.allocator, lambda: self.journal.state)
        self.servicer = AllocatorServicer(self.allocator, self.auth, self.metrics, self.journal)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._lease_task: asyncio.Task | None = None

    async def start(self) -> int:
        cfg = self.config
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        reject = lambda method, reason: self.metrics.rejected.labels(method.rsplit("/", 1)[-1], reason).inc()
        interceptor = AuthInterceptor(self.auth, reject)
        self.server = grpc.aio.server(interceptors=[interceptor], options=options)
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
        self._lease_task = asyncio.create_task(self._expire_leases())
        logger.info("kvservice serving on %s:%d (auth %s, TLS %s, persistence %s)", cfg.host, self.port,
                    "on" if self.auth.enabled else "OFF", "on" if cfg.tls_cert else "off", self.journal.state)
        return self.port

    async def _expire_leases(self) -> None:
        period = min(1.0, self.allocator.sessions.ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self.expire_leases_once()
            except Exception:  # a failed sweep must not stop future sweeps
                logger.exception("lease sweep failed")

    async def expire_leases_once(self) -> list[str]:
        now = time.monotonic()
        if not self.allocator.sessions.expired(now):
            return []
        self.journal.check_writable()
        expired = self.allocator.expire_sessions(now)
        for session_id in expired:
            logger.warning("lease of session %s lapsed: its requests were freed", session_id)
            self.metrics.lease_expiries.inc()
        await self.journal.record("expire", {"session_ids": expired})
        return expired

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    async def stop(self, grace: float = 1.0) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
        if self.server is not None:
            await self.server.stop(grace)

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


async def serve(config: ServerConfig, ready_line: bool = True) -> None:
    """Runs until SIGINT/SIGTERM."""
    server = AllocatorServer(config)
    port = await server.start()
    if ready_line:
        print(f"kvservice serving on {config.host}:{port}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
