"""The scheduler side's way to the allocator: its client (one, shared with the teller's thread), the prefix-index
replica, the store pools' epochs and NIXL endpoints, and what a failed call does (sharing pauses for
`retry_after_s`: requests are then computed, never answered from memory that may be gone)."""

from __future__ import annotations

import logging
import threading
import time

from kvservice.errors import session_lost
from kvservice.integrations.vllm.connector.plan import STORE_PREFIX, Load, Tracked, is_disk, is_store_pool
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.teller import Teller

logger = logging.getLogger(__name__)

EPOCH_REFRESH_S = 2.0


class AllocatorLink:
    def __init__(self, settings: ConnectorSettings, block_size: int, engine_id: str) -> None:
        self.settings, self.block_size, self.engine_id = settings, block_size, engine_id
        self.local_pool = STORE_PREFIX + settings.store if settings.store else None
        self._client = None
        self._index = None  # the PrefixIndex replica (settings.index), started on first use
        self.down_until = 0.0
        self.num_failures = 0
        self.num_lookup_rpcs = 0  # Lookups sent to the allocator (not answered by the replica)
        self.epochs: dict[str, int] = {}
        self.epochs_at = -1e9
        self._client_lock = threading.Lock()  # the step's calls and the teller's share one client
        self.teller = Teller(self.step, f"kvservice-connector-{engine_id}")
        self._disk_pool: str | None = None
        self._disk_at = -1e9
        self._pool_stats: dict = {}
        self.endpoints: dict[str, bytes] = {}  # store pool -> its NIXL endpoint, from the allocator
        self._sent: dict[str, bytes] = {}  # ...as the workers last got it
        self._serial = 0

    def client(self):
        if self._client is None:
            self._client = self.settings.client(self.block_size, f"kvconnector:{self.engine_id}:scheduler", 1)
        return self._client

    def step(self, pool_id: str, ops: list):
        """One Step on the allocator (the teller's thread and the step's path share the client)."""
        with self._client_lock:
            try:
                return self.client().step(pool_id, ops)
            except Exception as exc:
                if not session_lost(exc):
                    raise
                self.session_lost()  # the allocator restarted without our session (and its pins): a new one
                self.client().open_session()
                return self.client().step(pool_id, ops)

    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def failed(self, what: str, exc: BaseException) -> None:
        self.num_failures += 1
        if session_lost(exc):  # the allocator restarted without this session: its pins went with it
            self.session_lost()
            try:
                with self._client_lock:  # the teller's thread steps on the same client
                    self.client().open_session()
                logger.warning("kvservice connector: the allocator lost this engine's session; a new one is open")
                return
            except Exception as again:  # noqa: BLE001
                exc = again
        if self.available():
            logger.warning("kvservice connector: %s failed (%s: %s); sharing is off for %.0f s (requests are "
                           "computed)", what, type(exc).__name__, exc, self.settings.retry_after_s)
        self.down_until = time.monotonic() + self.settings.retry_after_s

    def session_lost(self) -> None:
        """The allocator lost this side's session (and the pins it held)."""

    def index(self):
        if self._index is None and self.settings.index:
            from kvservice.client import PrefixIndex
            self._index = PrefixIndex(self.client())
        return self._index

    def find(self, tracked: Tracked):
        """Per store pool, the cached prefix of the prompt: from the replica, else by a Lookup RPC."""
        pool_ids = [STORE_PREFIX + s for s in self.settings.stores]
        if pool_ids and self.local_disk() is not None:
            pool_ids.append(self.local_disk())
        index = self.index()
        if index is not None:
            before = index.remote_lookups
            found = index.lookup(tracked.prompt, cache_salt=tracked.cache_salt, pool_ids=pool_ids)
            self.num_lookup_rpcs += index.remote_lookups - before
            return found
        self.num_lookup_rpcs += 1
        return self.client().lookup(tracked.prompt, cache_salt=tracked.cache_salt, pool_ids=pool_ids)

    def generation(self, pool_id: str) -> int | None:
        """The pool's epoch now (and its endpoint noted: how other nodes reach its store's pages)."""
        index = self._index
        stats = index.pool_stats(pool_id) if index is not None else None
        if stats is None:
            now = time.monotonic()
            if pool_id not in self.epochs or now - self.epochs_at > EPOCH_REFRESH_S:
                self._pool_stats = {p: s for p, s in self.client().get_stats().pools.items() if is_store_pool(p)}
                self.epochs = {p: s.epoch for p, s in self._pool_stats.items()}
                self.epochs_at = now
            stats = self._pool_stats.get(pool_id)
        if stats is None:
            return None
        self.endpoints[pool_id] = getattr(stats, "endpoint", b"") or b""
        return stats.epoch

    def endpoints_for(self, loads: list[Load]) -> dict[str, bytes]:
        """The endpoints of this step's loads' stores the workers have not been sent yet (or that changed)."""
        out = {}
        for load in loads:
            endpoint = self.endpoints.get(load.pool_id, b"")
            if endpoint and self._sent.get(load.pool_id) != endpoint:
                out[load.pool_id] = self._sent[load.pool_id] = endpoint
        return out

    def local_disk(self) -> str | None:
        """This node's store's disk tier pool (from its descriptor, looked at again every few seconds)."""
        now = time.monotonic()
        if self.settings.store and now - self._disk_at > EPOCH_REFRESH_S:
            from kvservice.blockstore.segment import read_descriptor
            try:
                d = read_descriptor(self.settings.store, self.settings.shm_dir)
            except (OSError, ValueError, TypeError):
                d = None
            self._disk_pool = d.disk_pool_id or None if d is not None else None
            self._disk_at = now
        return self._disk_pool

    def rank(self, pool_id: str) -> int:
        """Which tier a hit of equal length is loaded from: this node's RAM, its disk, another node's RAM."""
        if pool_id == self.local_pool:
            return 3
        return 2 if is_disk(pool_id) else 1

    def next_id(self, req_id: str, kind: str) -> str:
        self._serial += 1
        return f"{self.engine_id}:{kind}:{req_id}:{self._serial}"

