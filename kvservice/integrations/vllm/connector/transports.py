"""How a worker reaches a store's pages: the store's shared-memory segment when it runs on this node, else a
transport to its node: one NIXL READ of the pages and their metadata (the store's agent info, its "endpoint",
comes from the allocator, which hands it only to the store's tenant), or, where NIXL does not work or the
store has no endpoint, the store's Ray actor and Ray's object store (`transport: nixl` refuses to start where
NIXL does not work: `choose_nixl`).

A store is on this node when its descriptor is in this node's shm_dir and the Ray node it names is this
process's (when both are known); the connector's `store` setting plays no part in reading.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvservice.blockstore.actor import NAMESPACE, actor_name, live_ray_address
from kvservice.blockstore.disk import DiskPages
from kvservice.blockstore.segment import MAX_SLOTS, META_FIELDS, Segment, read_descriptor
from kvservice.integrations.vllm.connector.settings import ENV_RAY_NODE, ConnectorSettings

logger = logging.getLogger(__name__)

DISK_READERS = 4  # page files read at once from a disk tier
REMOTE_READ_TIMEOUT_S = 10.0  # a load from another node's store that takes longer fails (and is recomputed)
RAY_RETRY_S = 10.0  # after a failed connect to Ray, loads through it fail at once for this long


class StoreUnreachable(LookupError):
    """The store's pages cannot be read from here (another node and no transport, a timeout)."""


@dataclass(slots=True)
class PageRead:
    """Pages to copy from: rows `rows` of `pages` (`[rows, page_bytes]` uint8, every rank's slices, or this
    rank's slice only when `sliced`), and their metadata as it is now (`meta()`: `[rows, MAX_SLOTS, 4]`; a
    segment's is live, read again after the copy). `private`: a copy read for this load alone (from another
    node or a disk), which nothing rewrites meanwhile."""

    pages: torch.Tensor
    rows: list[int]
    meta: Callable[[], np.ndarray]
    local: bool
    sliced: bool = False
    private: bool = False
    path: str = "local"  # how the pages came: local (this node's segment), nixl, ray, disk (timing.py)


def this_node() -> str:
    """This process's Ray node, or the node of the Ray process that started it, or "" (not known)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return os.environ.get(ENV_RAY_NODE, "")


class NixlPath:
    """This worker's NIXL agent and its receive buffers (registered once, grown when a load needs more)."""

    def __init__(self, name: str) -> None:
        from kvservice.blockstore.transports import NixlImport
        self.imp = NixlImport(name)
        self.pages: np.ndarray | None = None
        self.meta: np.ndarray | None = None
        self.num_reads = self.num_bytes = 0

    def _buffers(self, n: int, page_bytes: int) -> None:
        if self.pages is not None and self.pages.shape[0] >= n and self.pages.shape[1] == page_bytes:
            return
        for buf in (self.pages, self.meta):
            if buf is not None:
                self.imp.deregister(buf)
        rows = max(n, 64)
        self.pages = np.empty((rows, page_bytes), np.uint8)
        self.meta = np.zeros((rows, MAX_SLOTS, META_FIELDS), np.uint64)
        self.imp.register(self.pages)
        self.imp.register(self.meta)

    def read(self, name: str, endpoint: bytes, generation: int, page_ids: list[int]) -> PageRead:
        import json
        info = json.loads(endpoint)
        if info.get("segment_generation") != generation:
            raise LookupError(f"store {name!r} is not at generation {generation} (its agent says "
                              f"{info.get('segment_generation')}): it restarted; the pages named are gone")
        n = len(page_ids)
        self._buffers(n, int(info["page_bytes"]))
        ticket = self.imp.read(info, page_ids, self.pages[:n], self.meta[:n])
        try:
            if not ticket.wait(REMOTE_READ_TIMEOUT_S) or ticket.poll() != "DONE":
                raise StoreUnreachable(f"NIXL READ from store {name!r} failed: {ticket.error or 'timed out'}")
        finally:
            if not ticket.buffers_free:  # a READ NIXL could not cancel may still land: never reuse them
                self.pages = self.meta = None
            ticket.release()
        self.num_reads += 1
        self.num_bytes += n * int(info["page_bytes"])
        pages, meta = torch.from_numpy(self.pages[:n]), self.meta[:n].copy()
        return PageRead(pages, list(range(n)), lambda: meta, False, private=True, path="nixl")

    def close(self) -> None:
        self.imp.close()


def nixl_state() -> tuple[bool, str]:
    """(whether this process can move pages with NIXL, why not)."""
    try:
        from kvservice.blockstore.transports import nixl_available, nixl_unavailable_reason
    except ImportError as exc:
        return False, str(exc)
    return (True, "") if nixl_available() else (False, nixl_unavailable_reason())


def choose_nixl(transport: str) -> tuple[bool, str]:
    """(whether other nodes' pages move by NIXL, why not: "off" under transport 'ray'). Under 'nixl' a NIXL that
    does not work here refuses the engine's start (else every load from another node would fail); under 'auto'
    Ray takes over, with a warning."""
    if transport == "ray":
        return False, "off"
    on, why = nixl_state()
    if not on and transport == "nixl":
        raise ValueError(f"kv_connector_extra_config.transport: 'nixl', but NIXL does not work in this engine's "
                         f"environment ({why}): install it (pip install 'kvservice[nixl]'; nixl-cu13 on a CUDA 13 "
                         f"host), or set transport to 'auto' (NIXL where it works, else Ray) or 'ray'")
    if not on:
        logger.warning("kvservice connector: transport 'auto': NIXL does not work here (%s); pages of other nodes' "
                       "stores come through Ray (pip install 'kvservice[nixl]' for NIXL)", why)
    return on, why


class Stores:
    """This process's ways to the stores: segments of the stores on this node, NIXL (or Ray actors) to the
    others."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.endpoints: dict[str, bytes] = {}  # store name -> its NIXL endpoint (the connector's metadata)
        self._nixl: NixlPath | None = None
        self._disk_pool: ThreadPoolExecutor | None = None
        self.nixl_on, self.nixl_why = choose_nixl(settings.transport)
        self.segments: dict[str, tuple[str, Segment, torch.Tensor]] = {}
        self.actors: dict[str, object] = {}
        self._ray_down = (float("-inf"), "")  # when connecting to Ray last failed, and why
        self.node_id = this_node()
        self.num_local_reads = self.num_remote_reads = 0
        # Told of each segment's pages when first mapped and before one is dropped (the worker page-locks them).
        self.on_attach: Callable[[torch.Tensor], None] | None = None
        self.on_detach: Callable[[torch.Tensor], None] | None = None

    def transport_name(self) -> str:
        """What moves pages from other nodes' stores (logged at start-up)."""
        ray = "ray" if "ray" in sys.modules or _importable("ray") else ""
        if self.nixl_on:
            return "nixl" + (" (ray for stores with no NIXL endpoint)" if ray else "")
        why = f" (transport auto, NIXL does not work here: {self.nixl_why})" if self.nixl_why != "off" else ""
        return (ray or "none (neither NIXL nor Ray is installed)") + why

    def prepare(self, name: str) -> bool:
        """Maps the segment of this node's store `name` now, every page in place (the worker's own store, at
        start-up): its loads and saves then take no page faults and pay no mapping. False: not on this node."""
        return self._mapped(name, populate=True) is not None

    def _mapped(self, name: str, populate: bool) -> Segment | None:
        d = read_descriptor(name, self.settings.shm_dir)
        if d is None or (d.node_id and self.node_id and d.node_id != self.node_id):
            return None
        have = self.segments.get(name)
        if have is None or have[0] != d.path:
            if have is not None and self.on_detach is not None:
                self.on_detach(have[2])
            seg = Segment.attach(d, populate=populate)
            have = (d.path, seg, torch.from_numpy(seg.pages))
            self.segments[name] = have
            if self.on_attach is not None:
                self.on_attach(have[2])
        return have[1]

    def local(self, name: str, generation: int) -> Segment | None:
        """The segment of the store `name` if it runs on this node (at `generation`, else LookupError), or None
        when it is on another node. A segment first met here is mapped lazily (its pages fault in as they are
        first touched): mapping all of a large store would hold up this load by the store's size."""
        seg = self._mapped(name, populate=False)
        if seg is None:
            return None
        # The segment's own header, every time: a store that closed it, or restarted (or registered again) since
        # the pin or the page allocation was taken: its pages mean nothing now. (A store killed leaves its pinned
        # pages as they were committed: they still load, until its lease retires its pool.)
        if seg.closed:
            raise LookupError(f"store {name!r} on this node stopped: the pages named are gone")
        if seg.generation != generation:
            raise LookupError(f"store {name!r} on this node is not at generation {generation} (it restarted or "
                              f"registered again): the pages named are gone")
        return seg

    def read(self, name: str, generation: int, page_ids: list[int]) -> PageRead:
        seg = self.local(name, generation)
        if seg is not None:
            seg.check_ids(page_ids)
            return PageRead(self.segments[name][2], list(page_ids), lambda: seg.meta, True)
        endpoint = self.endpoints.get(name)
        if self.nixl_on and endpoint:
            if self._nixl is None:
                self._nixl = NixlPath(f"{os.getpid()}")
            return self._nixl.read(name, endpoint, generation, page_ids)
        if self.settings.transport == "nixl":
            raise StoreUnreachable(f"store {name!r} is on another node and transport is 'nixl': "
                                   f"{self.nixl_why or 'the store published no NIXL endpoint'}")
        try:
            data, meta = self._ray_read(name, generation, page_ids)
        except ImportError:
            raise StoreUnreachable(f"store {name!r} is on another node, and its pages come through Ray there: Ray "
                                   f"is not installed in this engine's environment (pip install ray)") from None
        with warnings.catch_warnings():  # Ray's zero-copy arrays are read-only; they are only read here
            warnings.simplefilter("ignore", UserWarning)
            return PageRead(torch.from_numpy(data), list(range(len(page_ids))), lambda: meta, False, private=True,
                            path="ray")

    def read_disk(self, name: str, epoch: int, page_ids: list[int], offset: int, width: int,
                  into: torch.Tensor) -> PageRead:
        """Slice (`offset`, `width` bytes) of the disk tier's pages of this node's store `name` at `epoch`, read
        into `into` (`[>= n, width]` uint8, host memory: a GPU engine's is page-locked)."""
        d = read_descriptor(name, self.settings.shm_dir)
        if d is None or not d.disk_dir or (d.node_id and self.node_id and d.node_id != self.node_id):
            raise StoreUnreachable(f"store {name!r}'s disk tier is not on this node: it is read on its node only")
        if d.disk_epoch != epoch:
            raise LookupError(f"store {name!r}'s disk tier is at epoch {d.disk_epoch}, not {epoch}: the pages "
                              f"named are not its")
        disk = DiskPages(d.disk_dir, d.page_bytes)
        metas = np.zeros((len(page_ids), MAX_SLOTS, META_FIELDS), np.uint64)

        def read(part: range) -> None:
            for i in part:
                metas[i] = disk.read_slice(page_ids[i], offset, into[i].numpy())
        # Several reads in flight (the GIL is released in them): a disk serves a queue faster than one read
        # at a time.
        n, k = len(page_ids), max(1, min(DISK_READERS, len(page_ids)))
        parts = [range(i * n // k, (i + 1) * n // k) for i in range(k)]
        if k > 1 and self._disk_pool is None:
            self._disk_pool = ThreadPoolExecutor(DISK_READERS - 1, thread_name_prefix="kvservice-disk-read")
        others = [self._disk_pool.submit(read, part) for part in parts[1:]]
        try:
            read(parts[0])
        finally:
            for other in others:
                other.result()
        return PageRead(into[:len(page_ids)], list(range(len(page_ids))), lambda: metas, True, sliced=True,
                        private=True, path="disk")

    def count(self, read: PageRead) -> None:
        if read.local:
            self.num_local_reads += 1
        else:
            self.num_remote_reads += 1

    @property
    def num_nixl_reads(self) -> int:
        return self._nixl.num_reads if self._nixl is not None else 0

    def _ray_read(self, name: str, generation: int, page_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        import ray
        try:
            return ray.get(self._actor(name).read.remote(page_ids, self.settings.token, generation, True),
                           timeout=REMOTE_READ_TIMEOUT_S)
        except Exception:
            self.actors.pop(name, None)  # look the store up again next time (it may have been restarted)
            raise

    def _actor(self, name: str):
        actor = self.actors.get(name)
        if actor is None:
            import ray
            if not ray.is_initialized():
                failed_at, why = self._ray_down
                if time.monotonic() - failed_at < RAY_RETRY_S:
                    raise ConnectionError(why)
                try:
                    address = live_ray_address(self.settings.ray_address)
                except ConnectionError as e:
                    self._ray_down = (time.monotonic(), str(e))
                    raise
                ray.init(address=address, namespace=NAMESPACE, ignore_reinit_error=True, log_to_driver=False)
            actor = ray.get_actor(actor_name(name), namespace=NAMESPACE)
            self.actors[name] = actor
        return actor

    def writable(self, name: str, generation: int) -> torch.Tensor:
        if self.local(name, generation) is None:
            raise LookupError(f"store {name!r} is not on this node: saves go to this node's store only")
        return self.segments[name][2]

    def disk_of(self, name: str, epoch: int) -> DiskPages:
        """The disk tier of this node's store `name` at `epoch` (where a save allocated then is written
        through); LookupError when the store has none now or another one (its pages mean something else)."""
        d = read_descriptor(name, self.settings.shm_dir)
        if d is None or not d.disk_dir:
            raise LookupError(f"store {name!r} has no disk tier now")
        if d.disk_epoch != epoch:
            raise LookupError(f"store {name!r}'s disk tier is at epoch {d.disk_epoch}, not {epoch}")
        return DiskPages(d.disk_dir, d.page_bytes)

    def writable_meta(self, name: str) -> np.ndarray:
        return self.segments[name][1].meta

    def close(self) -> None:
        if self._disk_pool is not None:
            self._disk_pool.shutdown()
        if self.on_detach is not None:
            for _, _, pages in self.segments.values():
                self.on_detach(pages)
        self.segments.clear()
        if self._nixl is not None:
            self._nixl.close()


def _importable(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None
