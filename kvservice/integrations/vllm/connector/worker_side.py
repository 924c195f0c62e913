"""The connector's worker side (each vLLM worker process): copies pages between the engine's paged KV memory
and the store tier, then tells the allocator (in a thread of its own, off the step).

A page is one block of every layer: `kv_layer[block_id]` of each layer, in the order of the layer names, as
opaque bytes (vLLM's CPU attention keeps K transposed inside a block, so only whole blocks are moved). On the
store's node the pages are read and written in its shared-memory segment; from another node they come from
the store's Ray actor through Ray's object store.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import warnings
from collections import OrderedDict

import torch

from kvservice.blockstore.actor import NAMESPACE, actor_name
from kvservice.blockstore.saves import commit_save
from kvservice.blockstore.segment import Segment, read_descriptor
from kvservice.errors import session_lost
from kvservice.integrations.vllm.connector.plan import Load, Save, store_name
from kvservice.integrations.vllm.connector.settings import ENV_RAY_NODE, ConnectorSettings
from kvservice.ops import FreeOp, OpStatus, UnpinOp

logger = logging.getLogger(__name__)

REMOTE_READ_TIMEOUT_S = 10.0  # a load from another node's store that takes longer fails (and is recomputed)
FAILED_KEPT = 4096  # requests whose load failed, remembered so that no later save copies their blocks
RETRY_S = 1.0  # unpins and frees the allocator did not take are sent again this much later
MAX_TRIES = 600


def runs(a: list[int], b: list[int]) -> list[tuple[int, int]]:
    """(position, length) of the maximal stretches where both id lists count up by one: each is one strided
    copy per layer instead of one per block."""
    out, i, n = [], 0, len(a)
    while i < n:
        k = 1
        while i + k < n and a[i + k] == a[i] + k and b[i + k] == b[i] + k:
            k += 1
        out.append((i, k))
        i += k
    return out


class PageLayout:
    """Where each layer's block sits in a page: layer by layer in the order of their names, each layer's block
    as its bytes (`kv_layer[block_id]`, contiguous with the blocks on dim 0)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None) -> None:
        self.layers: list[tuple[torch.Tensor, int, int]] = []  # (the layer as [num_blocks, bytes], offset, bytes)
        offset = 0
        for name in sorted(kv_caches):
            t = kv_caches[name]
            if num_blocks is not None and t.shape[0] != num_blocks:
                raise ValueError(f"KVServiceConnector: layer {name!r} has KV shape {tuple(t.shape)}; it needs the "
                                 f"blocks on dim 0 ({num_blocks} of them), as vLLM's CPU attention lays them out")
            if not t.is_contiguous():
                raise ValueError(f"KVServiceConnector: layer {name!r}'s KV tensor is not contiguous")
            flat = t.view(t.shape[0], -1).view(torch.uint8)
            self.layers.append((flat, offset, flat.shape[1]))
            offset += flat.shape[1]
        self.page_bytes = offset

    def save(self, pages: torch.Tensor, block_ids: list[int], page_ids: list[int]) -> None:
        """The engine's blocks into rows `page_ids` of `pages` (`[rows, page_bytes]` uint8)."""
        for i, k in runs(block_ids, page_ids):
            b, p = block_ids[i], page_ids[i]
            for flat, offset, size in self.layers:
                pages[p:p + k, offset:offset + size].copy_(flat[b:b + k])

    def load(self, pages: torch.Tensor, page_ids: list[int], block_ids: list[int]) -> None:
        """Rows `page_ids` of `pages` into the engine's blocks."""
        for i, k in runs(block_ids, page_ids):
            b, p = block_ids[i], page_ids[i]
            for flat, offset, size in self.layers:
                flat[b:b + k].copy_(pages[p:p + k, offset:offset + size])


def this_node() -> str:
    """This process's Ray node, or the node of the Ray process that started it, or "" (not known)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return os.environ.get(ENV_RAY_NODE, "")


class Stores:
    """This process's ways to the stores: segments of the stores on this node, actors of the others."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.segments: dict[str, tuple[str, Segment, torch.Tensor]] = {}
        self.node_id = this_node()
        self.actors: dict[str, object] = {}
        self.num_local_reads = self.num_remote_reads = 0

    def local(self, name: str, generation: int) -> torch.Tensor | None:
        """The pages of the store `name` if it runs on this node (at `generation`, else LookupError), or None
        when it is on another node. On this node means: its descriptor is in this node's shm_dir, and the Ray
        node it names is this process's (when both are known); the `store` setting plays no part."""
        d = read_descriptor(name, self.settings.shm_dir)
        if d is None or (d.node_id and self.node_id and d.node_id != self.node_id):
            return None
        have = self.segments.get(name)
        if have is None or have[0] != d.path:
            seg = Segment.attach(d)
            have = (d.path, seg, torch.from_numpy(seg.pages))
            self.segments[name] = have
        seg = have[1]
        # The segment's own header, every time: a store that closed it, or restarted (or registered again) since
        # the pin or the page allocation was taken: its pages mean nothing now. (A store killed leaves its pinned
        # pages as they were committed: they still load, until its lease retires its pool.)
        if seg.closed:
            raise LookupError(f"store {name!r} on this node stopped: the pages named are gone")
        if seg.generation != generation:
            raise LookupError(f"store {name!r} on this node is not at generation {generation} (it restarted or "
                              f"registered again): the pages named are gone")
        return have[2]

    def actor(self, name: str):
        actor = self.actors.get(name)
        if actor is None:
            try:
                import ray
            except ImportError:
                raise LookupError(f"store {name!r} is on another node, and its pages come through Ray there: Ray "
                                  f"is not installed in this engine's environment (pip install ray)") from None
            if not ray.is_initialized():
                ray.init(address=self.settings.ray_address or "auto", namespace=NAMESPACE,
                         ignore_reinit_error=True, log_to_driver=False)
            actor = ray.get_actor(actor_name(name), namespace=NAMESPACE)
            self.actors[name] = actor
        return actor

    def read(self, name: str, generation: int, page_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Where the pages are: this node's segment and their rows in it, or a copy fetched from the store's
        actor (another node) and rows 0..n-1."""
        pages = self.local(name, generation)
        if pages is not None:
            self.num_local_reads += 1
            return pages, page_ids
        import ray
        try:
            data = ray.get(self.actor(name).read.remote(page_ids, self.settings.token, generation),
                           timeout=REMOTE_READ_TIMEOUT_S)
        except Exception:
            self.actors.pop(name, None)  # look the store up again next time (it may have been restarted)
            raise
        self.num_remote_reads += 1
        with warnings.catch_warnings():  # Ray's zero-copy arrays are read-only; they are only read here
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data), list(range(len(page_ids)))

    def writable(self, name: str, generation: int) -> torch.Tensor:
        pages = self.local(name, generation)
        if pages is None:
            raise LookupError(f"store {name!r} is not this node's store ({self.settings.store!r}): saves go to "
                              f"the local store only")
        return pages


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, block_size: int, engine_id: str) -> None:
        self.settings, self.block_size, self.engine_id = settings, block_size, engine_id
        self.layout: PageLayout | None = None
        self.stores = Stores(settings)
        self.failed_blocks: set[int] = set()
        self.failed_requests: OrderedDict[str, None] = OrderedDict()  # loads failed, in any earlier step
        self.num_loaded_blocks = self.num_saved_blocks = self.num_failed_loads = 0
        # seconds on the step's path: fetching pages (another node's), copying them in, the unpin Step, saves
        self.fetch_s = self.copy_in_s = self.unpin_s = self.copy_out_s = 0.0
        self._tell: queue.Queue = queue.Queue()
        self._teller: threading.Thread | None = None
        self._client = None
        self._client_lock = threading.Lock()  # the step's unpins and the teller's commits share one client
        self._retry: list[tuple[float, int, str, list]] = []  # (when, tries, pool, ops) the allocator did not take

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None) -> None:
        self.layout = PageLayout(kv_caches, num_blocks)

    # ---- loads: before the forward (vLLM calls start_load_kv first when a step has sync loads) ----------
    def load(self, loads: list[Load]) -> None:
        """Copies each load's pages in, then unpins them all (one Step per store): a pin that is no longer
        there (released with a lapsed lease, or its store restarted) means the pages may have been reused
        while they were copied, so those blocks are reported failed and vLLM recomputes them."""
        unpins: dict[str, list[Load]] = {}
        for load in loads:
            try:
                if load.store_block_ids:
                    start = time.perf_counter()
                    pages, rows = self.stores.read(store_name(load.pool_id), load.generation, load.store_block_ids)
                    fetched = time.perf_counter()
                    self._check_pages(pages, load.pool_id)
                    self.layout.load(pages, rows, load.local_block_ids)
                    self.fetch_s += fetched - start
                    self.copy_in_s += time.perf_counter() - fetched
                    self.num_loaded_blocks += len(load.local_block_ids)
            except Exception as exc:  # noqa: BLE001 - any failure: vLLM recomputes these blocks
                self._failed(load, f"{type(exc).__name__}: {exc}")
            unpins.setdefault(load.pool_id, []).append(load)
        start = time.perf_counter()
        for pool_id, group in unpins.items():
            try:
                results = self._step(pool_id, [UnpinOp(load.pin_id) for load in group])
            except Exception as exc:  # noqa: BLE001 - unconfirmed pins: their blocks are recomputed
                results = [None] * len(group)
                reason = f"the allocator did not confirm the pins ({type(exc).__name__}: {exc})"
                self._later(pool_id, [UnpinOp(load.pin_id) for load in group])  # released once it answers
            for load, r in zip(group, results):
                if r is None or r.status != OpStatus.OK:
                    self._failed(load, reason if r is None else f"its pin was gone ({r.message})")
        self.unpin_s += time.perf_counter() - start

    def _failed(self, load: Load, reason: str) -> None:
        if self.failed_blocks.isdisjoint(load.local_block_ids):
            self.num_failed_loads += 1
            logger.warning("kvservice connector: loading %d blocks of %s from %s failed (%s); they are recomputed",
                           len(load.local_block_ids), load.req_id, load.pool_id, reason)
        self.failed_blocks.update(load.local_block_ids)
        self.failed_requests[load.req_id] = None
        if len(self.failed_requests) > FAILED_KEPT:
            self.failed_requests.popitem(last=False)

    def _check_pages(self, pages: torch.Tensor, pool_id: str) -> None:
        if pages.shape[1] != self.layout.page_bytes:
            raise ValueError(f"store {pool_id!r} keeps pages of {pages.shape[1]} bytes; this engine's are "
                             f"{self.layout.page_bytes} (another model, dtype or block size)")

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    # ---- saves: after the forward (wait_for_save) ------------------------------------------------------
    def save(self, saves: list[Save]) -> None:
        for save in saves:
            ops = commit_save(save.save_id, save.num_tokens)
            try:
                if save.req_id in self.failed_requests or self.failed_blocks.intersection(save.local_block_ids):
                    raise LookupError("a load of its blocks failed (they are recomputed, not saved)")
                if save.store_block_ids:
                    start = time.perf_counter()
                    pages = self.stores.writable(store_name(save.pool_id), save.generation)
                    self._check_pages(pages, save.pool_id)
                    self.layout.save(pages, save.local_block_ids, save.store_block_ids)
                    self.copy_out_s += time.perf_counter() - start
                    self.num_saved_blocks += len(save.store_block_ids)
            except Exception as exc:  # noqa: BLE001 - not saved: free the store pages uncached
                logger.warning("kvservice connector: saving %s into %s failed (%s: %s)", save.req_id,
                               save.pool_id, type(exc).__name__, exc)
                ops = [FreeOp(save.save_id)]
            self._later(save.pool_id, ops)

    # ---- telling the allocator, off the step --------------------------------------------------------
    def _later(self, pool_id: str, ops: list) -> None:
        if self._teller is None:
            self._teller = threading.Thread(target=self._tell_loop, name="kvservice-connector", daemon=True)
            self._teller.start()
        self._tell.put((pool_id, ops))

    def _tell_loop(self) -> None:
        stop = False
        while not stop:
            try:
                batch = [self._tell.get(timeout=RETRY_S if self._retry else None)]
            except queue.Empty:
                batch = []
            while True:  # everything queued meanwhile goes in one Step per pool
                try:
                    batch.append(self._tell.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            now = time.monotonic()
            due = [(tries, pool, ops) for when, tries, pool, ops in self._retry if when <= now]
            self._retry = [r for r in self._retry if r[0] > now]
            self._send([(pool, ops, 0) for pool, ops in (b for b in batch if b is not None)]
                       + [(pool, ops, tries) for tries, pool, ops in due])
            for _ in batch:
                self._tell.task_done()

    def _send(self, batch: list[tuple[str, list, int]]) -> None:
        by_pool: dict[str, tuple[list, int]] = {}
        for pool_id, ops, tries in batch:
            have, most = by_pool.get(pool_id, ([], 0))
            by_pool[pool_id] = (have + ops, max(most, tries))
        for pool_id, (ops, tries) in by_pool.items():
            try:
                results = self._step(pool_id, ops)
                bad = [r for r in results if r.status not in (OpStatus.OK, OpStatus.NOT_FOUND)]
                if bad:
                    logger.warning("kvservice connector: %s refused %s", pool_id, bad[0].message)
            except Exception as exc:  # noqa: BLE001 - sent again later: a pin or page must not stay held
                if tries + 1 < MAX_TRIES:
                    self._retry.append((time.monotonic() + RETRY_S, tries + 1, pool_id, self._retryable(ops)))
                if tries == 0:
                    logger.warning("kvservice connector: telling %s failed (%s: %s); trying again", pool_id,
                                   type(exc).__name__, exc)

    @staticmethod
    def _retryable(ops: list) -> list:
        """What is safe to send again: unpins and frees (NOT_FOUND once done); a commit after a failure
        becomes a plain free (its pages are not known to have been cached)."""
        return [op for op in ops if isinstance(op, (UnpinOp, FreeOp))]

    def _step(self, pool_id: str, ops: list):
        with self._client_lock:
            try:
                return self.client().step(pool_id, ops)
            except Exception as exc:
                if not session_lost(exc):
                    raise
                self.client().open_session()  # the allocator restarted without our session: a new one
                return self.client().step(pool_id, ops)

    def client(self):
        if self._client is None:
            self._client = self.settings.client(self.block_size, f"kvconnector:{self.engine_id}:worker", 2)
        return self._client

    def flush(self) -> None:
        """Waits until everything queued was told (tests, shutdown)."""
        if self._teller is not None:
            self._tell.join()

    def close(self) -> None:
        if self._teller is not None:
            self._tell.put(None)
            self._teller.join(timeout=5)
        if self._client is not None:
            self._client.close()
