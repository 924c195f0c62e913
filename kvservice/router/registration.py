"""External pools the router registers itself: a backend that names its KV events endpoints (`events=`,
`replay=`) gets its pool subscribed on the allocator (RegisterExternalPool, idempotent) as the router's
`--token` tenant, retried until the allocator takes it; so engines that join through the backends file need
no `--vllm-events` restart of the allocator. Removed backends' pools are left registered (their index stays
useful to a backend that comes back; `kvservice status` lists them)."""

from __future__ import annotations

import asyncio
import logging

from kvservice.router.backends import Backend
from kvservice.router.background import Background
from kvservice.router.settings import RouterSettings
from kvservice.router.tenants import Tenants

logger = logging.getLogger(__name__)
RETRY_S = 2.0


class Registrar(Background):
    def __init__(self, settings: RouterSettings, tenants: Tenants) -> None:
        self.settings = settings
        self.tenants = tenants
        self.pending: dict[str, Backend] = {}
        self.done: dict[str, Backend] = {}
        self._wake = asyncio.Event()

    def wanted(self, backends: list[Backend]) -> None:
        for b in backends:
            if b.events and self.done.get(b.pool) != b:
                self.pending[b.pool] = b
        if self.pending:
            self._wake.set()

    async def register(self, b: Backend) -> None:
        client = self.tenants.client(self.tenants.token)
        await asyncio.wait_for(client.register_external_pool(
            b.pool, b.events, b.replay, block_size=b.block_size or self.settings.block_size, hash_algo=b.hash),
            max(5.0, self.settings.lookup_timeout_s))

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            for pool, backend in list(self.pending.items()):
                try:
                    await self.register(backend)
                except Exception as exc:  # noqa: BLE001 - retried: the allocator may be starting
                    logger.warning("kvservice route: registering %s's events (%s) failed: %s; retrying",
                                   backend.name, backend.events, exc)
                    continue
                logger.info("kvservice route: external pool %s subscribed to %s", pool, backend.events)
                self.done[pool] = self.pending.pop(pool)
            if self.pending:
                await asyncio.sleep(RETRY_S)
                self._wake.set()
