"""The connector's worker side (each vLLM worker process, one per tensor-parallel rank): copies pages between the
engine's paged KV memory and the store tier, and reports what it finished to the scheduler side (`Done`, in
vLLM's worker metadata), which talks to the allocator.

A page (pageformat.py) is one scheduler block of every layer in kvservice's canonical order, whatever the
engine's attention layout; a store page holds every rank's page side by side (rank r's at `r * page_bytes`).
Each slice carries metadata in the segment (segment.py): the tag of the save that wrote it, its checksum and
its format. A writer clears the tag before it copies and sets it (after the checksum and format) once its copy
completed; a reader checks the tag and format before it copies and the tag again after (a seqlock: a slice
rewritten meanwhile shows another tag), and the checksum when `verify_checksums` is on. Any doubt is a failed
block: vLLM recomputes it. A checksum fails only its own page: the load's blocks before it are kept, the rest
recomputed (vLLM's computed tokens are a prefix); any other doubt fails the load's every block.

On the store's node the pages are read and written in its shared-memory segment; from another node they come
through `Stores.read` (transports.py). This file holds the loads and what a rank reports; the saves, their
sealing, the disk write-through and the polling of finished copies (loads' included) are worker_saves.py's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from kvservice.blockstore.segment import CHECKSUM, FORMAT, TAG
from kvservice.integrations.vllm.connector.counters import Counters, FailReason
from kvservice.integrations.vllm.connector.movers import make_mover
from kvservice.integrations.vllm.connector.pagecheck import PageCheckError, checksum, digest64
from kvservice.integrations.vllm.connector.pageformat import PageFormat
from kvservice.integrations.vllm.connector.plan import Done, Load, is_disk, store_name, tier_label
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.timing import Parts, gbps, ms
from kvservice.integrations.vllm.connector.transports import Stores, StoreUnreachable
from kvservice.integrations.vllm.connector.worker_saves import DISK_QUEUE, SaveCopies

logger = logging.getLogger(__name__)

FAILED_KEPT = 4096  # requests whose load failed, remembered so that no later save copies their blocks


class WorkerSide(SaveCopies):
    def __init__(self, settings: ConnectorSettings, block_size: int, engine_id: str, *, rank: int = 0,
                 world_size: int = 1, layout: str | None = None, head_size: int | None = None,
                 cache_dtype: str | None = None, cpu_attention: bool | None = None) -> None:
        self.settings, self.block_size, self.engine_id = settings, block_size, engine_id
        self.rank, self.world_size = rank, world_size
        self.layout, self.head_size, self.cache_dtype = layout, head_size, cache_dtype
        self.cpu_attention = cpu_attention  # vLLM's CPU attention layout (None: when the KV is on the CPU)
        self.fmt: PageFormat | None = None
        self.mover = None
        self.format_digest = 0
        self.stores = Stores(settings)
        self.counters = Counters()
        self.failed_blocks: set[int] = set()
        self.failed_requests: OrderedDict[str, None] = OrderedDict()  # loads failed, in any earlier step
        self.num_loaded_blocks = self.num_saved_blocks = self.num_failed_loads = 0
        # seconds on the step's path: fetching pages (another node's), checking and copying them in, saves
        self.fetch_s = self.copy_in_s = self.copy_out_s = 0.0
        self.load_parts = Parts()  # the same, part by part and per path (timing.py)
        self._lock = threading.Lock()
        self._done = Done()
        self._recving: set[str] = set()  # asynchronous loads finished (vLLM's finished_recving)
        self._saving: dict[int, tuple] = {}  # mover job -> (save, its pages, their metadata) being copied
        self._saves_of: dict[str, set[str]] = {}  # request -> its saves not sealed yet
        self._seal: queue.Queue = queue.Queue()
        self._sealer: threading.Thread | None = None
        self._job = 0
        self._disk_buffer: torch.Tensor | None = None
        self._load_results: dict[int, bool] = {}  # load jobs completed, until their load looks
        self._delayed: set[str] = set()  # requests whose blocks vLLM keeps until this rank's saves of them settle
        self._client = None  # the allocator, only to check a remote load's pin
        self._disk_writes: queue.Queue = queue.Queue(maxsize=DISK_QUEUE)
        self._disk_writer: threading.Thread | None = None

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None,
                 scales: dict[str, tuple[float, float]] | None = None) -> None:
        """The engine's KV views (vLLM's `register_kv_caches`); `scales`: each layer's (k_scale, v_scale) of a
        quantised cache, which the page format digest pins (pages written under other scales fail to load)."""
        first = next(iter(kv_caches.values()))
        if num_blocks is None:
            num_blocks = first.shape[0]
        cpu = first.device.type == "cpu" if self.cpu_attention is None else self.cpu_attention
        cpu_isa = cpu_attention_isa(first.dtype, self.block_size, self.head_size, self.cache_dtype) if cpu else None
        self.fmt = PageFormat.build(kv_caches, num_blocks=num_blocks, block_size=self.block_size, layout=self.layout,
                                    cpu_isa=cpu_isa, head_size=self.head_size, cache_dtype=self.cache_dtype)
        self.mover = make_mover(self.fmt)
        # The store's segment page-locked once it is mapped (a GPU's copies into it then need no bounce).
        self.stores.on_attach, self.stores.on_detach = self.mover.pin, self.mover.unpin
        if self.settings.store not in (None, "auto"):  # this node's store, named: mapped (and pinned) now
            try:
                self.stores.prepare(self.settings.store)
            except (OSError, ValueError) as exc:  # mapped at first use instead
                logger.info("kvservice connector: store %r not mapped at start-up (%s)", self.settings.store, exc)
        scale_text = ";".join(f"{n}={k!r},{v!r}" for n, (k, v) in sorted((scales or {}).items()))
        self.format_digest = digest64(self.fmt.format_id + (f";scales={scale_text}" if scales else ""))
        logger.info("kvservice connector: rank %d of %d, pages of %d bytes (%s), %s copies, remote stores via %s",
                    self.rank, self.world_size, self.fmt.page_bytes, self.fmt.format_id, type(self.mover).__name__,
                    self.stores.transport_name())

    @property
    def page_bytes(self) -> int:
        return self.fmt.page_bytes

    def _slice(self, pages: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a store's pages."""
        width = self.fmt.page_bytes
        if pages.shape[1] != width * self.world_size:
            raise PageCheckError(FailReason.FORMAT,
                                 f"the store keeps pages of {pages.shape[1]} bytes; this engine's are {width} x "
                                 f"{self.world_size} ranks (another model, dtype, block size or TP size)")
        return pages[:, self.rank * width:(self.rank + 1) * width]

    # ---- loads: before the forward (vLLM calls start_load_kv first when a step has sync loads) ----------
    def load(self, loads: list[Load], endpoints: dict[str, bytes] | None = None) -> None:
        """Copies each load's pages in and checks them. Every load (done or failed) is reported in `Done.loads`
        so the scheduler side unpins it; asynchronous ones are also reported finished to vLLM. `endpoints`: the
        NIXL endpoints of stores (by pool) the scheduler side learned since it last sent them."""
        for pool_id, endpoint in (endpoints or {}).items():
            self.stores.endpoints[store_name(pool_id)] = endpoint
        for load in loads:
            try:
                if load.failed:
                    raise PageCheckError(FailReason.TIMEOUT if load.failed == "timeout" else FailReason.OTHER,
                                         f"nothing to load ({load.failed})")
                if load.store_block_ids:
                    self._load(load)
            except Exception as exc:  # noqa: BLE001 - any failure: vLLM recomputes these blocks
                reason = getattr(exc, "reason", FailReason.UNREACHABLE if isinstance(exc, StoreUnreachable)
                                 else FailReason.OTHER)
                self._failed(load, reason, f"{type(exc).__name__}: {exc}", getattr(exc, "loaded", 0))
            with self._lock:
                if load.pin_id:
                    self._done.loads[load.pin_id] = self._done.loads.get(load.pin_id, 0) + 1
                if load.async_load:
                    self._recving.add(load.req_id)

    def _load(self, load: Load) -> None:
        t0 = time.perf_counter()
        name, disk = store_name(load.pool_id), is_disk(load.pool_id)
        if disk:  # this rank's slices from the page files, into a buffer of this rank's
            width = self.fmt.page_bytes
            read = self.stores.read_disk(name, load.generation, load.store_block_ids, self.rank * width, width,
                                         self._staging(len(load.store_block_ids)))
        else:
            read = self.stores.read(name, load.generation, load.store_block_ids)
        t1 = time.perf_counter()
        pages = read.pages if read.sliced else self._slice(read.pages)
        before = self._check_meta(read.meta(), read.rows, load)
        t2 = time.perf_counter()
        # A disk page is always checked (its file may have been altered while nobody looked); a RAM page under
        # verify_checksums. A private copy (a disk's, another node's) is checked before it is copied in.
        verify = disk or self.settings.verify_checksums
        good = len(read.rows)  # the leading pages that passed every check: what this load delivers
        if verify and read.private:
            good = self._verify(load, pages, read.rows, before)
        t3 = time.perf_counter()
        if good:
            self._job += 1
            job = self._job
            self.mover.submit_load(job, pages, read.rows[:good], load.local_block_ids[:good])
            self.mover.wait([job])
            self._poll()  # the load's result, and any save that completed meanwhile (sealed, never dropped)
            if not self._load_results.pop(job, False):
                raise PageCheckError(FailReason.OTHER, "the copy into the engine failed")
        t4 = time.perf_counter()
        if not read.private:
            after = self._check_meta(read.meta(), read.rows, load)
            if not np.array_equal(before[:, TAG], after[:, TAG]):
                raise PageCheckError(FailReason.PIN_LOST, "a page was rewritten while it was read (its pin was gone)")
        t5 = time.perf_counter()
        if verify and not read.private:
            good = self._verify(load, pages, read.rows, after)
        t6 = time.perf_counter()
        if not read.local and load.pin_id and not self._pin_held(load):
            raise PageCheckError(FailReason.PIN_LOST, f"its pin on {load.pool_id} lapsed during the transfer: the "
                                 f"pages may have been reused meanwhile")
        t7 = time.perf_counter()
        self.stores.count(read)
        self.fetch_s += t1 - t0
        self.copy_in_s += t7 - t1
        self.num_loaded_blocks += good
        label, nbytes = tier_label(load.pool_id), good * self.fmt.page_bytes
        self.counters.add("loaded", label, good)
        self.counters.add("bytes_loaded", label, nbytes)
        self._timed(load, read.path, len(read.rows), nbytes, fetch=t1 - t0, check=(t2 - t1) + (t5 - t4),
                    verify=(t3 - t2) + (t6 - t5) if verify else 0.0, copy=t4 - t3, pin_check=t7 - t6)
        if good < len(read.rows):
            raise PageCheckError(FailReason.CHECKSUM, f"page {load.store_block_ids[good]} of {load.pool_id}: its "
                                 f"bytes do not match their checksum ({good} blocks before it loaded)", loaded=good)

    def _timed(self, load: Load, path: str, blocks: int, nbytes: int, **parts: float) -> None:
        for part, seconds in parts.items():
            self.load_parts.add(path, part, seconds)
        self.load_parts.count(path, "loads", 1)
        self.load_parts.count(path, "blocks", blocks)
        self.load_parts.count(path, "bytes", nbytes)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kvservice connector: rank %d loaded %d blocks (%.1f MiB) of %s from %s over %s: %s; copy "
                         "%s", self.rank, blocks, nbytes / 2**20, load.req_id, load.pool_id, path,
                         ", ".join(f"{part} {ms(s)}" for part, s in parts.items()), gbps(nbytes, parts["copy"]))

    def _pin_held(self, load: Load) -> bool:
        """Whether the load's pin outlived the transfer from another node (one read RPC): a pin that is still
        held was held all along, so its pages were not reused while they travelled."""
        from kvservice.errors import NotFound
        if self._client is None:
            self._client = self.settings.client(self.block_size, f"kvconnector:{self.engine_id}:rank{self.rank}", 1)
        try:
            self._client.get_request(load.pool_id, load.pin_id)
            return True
        except NotFound:
            return False

    def _verify(self, load: Load, pages: torch.Tensor, rows: list[int], meta: np.ndarray) -> int:
        """The number of leading pages whose bytes match their checksum; every page that does not is counted and
        dropped from the index (the scheduler side evicts it: it must not hit again)."""
        bad = [i for i, row in enumerate(rows) if checksum(pages[row].numpy()) != int(meta[i, CHECKSUM])]
        if bad:
            self.counters.add("checksum_failures", "disk" if is_disk(load.pool_id) else "ram", len(bad))
            with self._lock:
                self._done.evict.setdefault(load.pool_id, []).extend(load.store_block_ids[i] for i in bad)
        return bad[0] if bad else len(rows)

    def _staging(self, n: int) -> torch.Tensor:
        """A host buffer of at least `n` of this rank's pages, for reads from a disk tier (page-locked for a
        GPU's copies)."""
        have = self._disk_buffer
        if have is None or have.shape[0] < n:
            have = torch.empty(max(n, 64), self.fmt.page_bytes, dtype=torch.uint8,
                               pin_memory=self.fmt.device.type == "cuda")
            self._disk_buffer = have
        return have

    def _check_meta(self, meta: np.ndarray, rows: list[int], load: Load) -> np.ndarray:
        """This rank's metadata of the rows read (`[n, 4]`); PageCheckError for a slice being written or never
        written (tag 0), holding another block than the load's (its tag names another prefix), or of another
        format."""
        pool_id = load.pool_id
        mine = np.asarray(meta[rows, self.rank]) if len(rows) else np.zeros((0, 4), np.uint64)
        if (mine[:, TAG] == 0).any():
            raise PageCheckError(FailReason.PIN_LOST, f"a page of {pool_id} is being written or was never written")
        if load.tags and not np.array_equal(mine[:, TAG], np.asarray(load.tags, dtype=np.uint64)):
            raise PageCheckError(FailReason.PIN_LOST, f"a page of {pool_id} holds another prefix than the one "
                                 f"pinned (reused while its pin was gone, or an index that lost track of it)")
        if (mine[:, FORMAT] != self.format_digest).any():
            raise PageCheckError(FailReason.FORMAT, f"a page of {pool_id} holds another format than this engine's "
                                 f"({self.fmt.format_id}): another layout, scale or size")
        return mine.copy()

    def _failed(self, load: Load, reason: str, message: str, loaded: int = 0) -> None:
        """The load's blocks from `loaded` on failed: vLLM keeps the ones before and recomputes these."""
        failed = load.local_block_ids[loaded:]
        if self.failed_blocks.isdisjoint(failed):
            self.num_failed_loads += 1
            logger.warning("kvservice connector: loading %d blocks of %s from %s failed (%s); they are recomputed",
                           len(failed), load.req_id, load.pool_id, message)
        self.counters.add("failed", tier_label(load.pool_id), len(failed), reason)
        self.failed_blocks.update(failed)
        self.failed_requests[load.req_id] = None
        if len(self.failed_requests) > FAILED_KEPT:
            self.failed_requests.popitem(last=False)

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    # ---- what this rank reports ------------------------------------------------------------------------
    def take_done(self) -> Done | None:
        self._poll()
        with self._lock:
            done, self._done = self._done, Done()
        return done if done else None

    def delay(self, req_ids: list[str]) -> None:
        """Requests whose blocks vLLM keeps until every rank reports them in finished_sending (the scheduler
        side said so in the metadata: it delayed their free while a save of theirs was in flight)."""
        with self._lock:
            self._delayed.update(req_ids)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's get_finished: the delayed requests whose saves on this rank are all sealed (or never
        started here), and the asynchronous loads done."""
        self._poll()
        with self._lock:
            sending = {r for r in self._delayed if r not in self._saves_of}
            self._delayed -= sending
            recving, self._recving = self._recving, set()
        return sending or None, recving or None

    def flush(self) -> None:
        """Waits until every save submitted is sealed and written through (tests, shutdown)."""
        if self.mover is not None:
            self.mover.wait(list(self._saving))
        self._poll()
        if self._sealer is not None:
            self._seal.join()
        if self._disk_writer is not None:
            self._disk_writes.join()

    def close(self) -> None:
        self.flush()
        for thread, q in ((self._sealer, self._seal), (self._disk_writer, self._disk_writes)):
            if thread is not None:
                q.put(None)
                thread.join(timeout=5)
        self.stores.close()
        if self.mover is not None:
            self.mover.close()
        if self._client is not None:
            self._client.close()


def cpu_attention_isa(dtype: torch.dtype, block_size: int, head_size: int | None, cache_dtype: str | None) -> str:
    """The ISA vLLM's CPU attention lays a block out for (its packing of K differs per ISA)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return "vec"  # no vLLM CPU backend here (tests): the plain vec layout
    try:
        return _get_attn_isa(dtype, block_size, head_size, cache_dtype)
    except TypeError:
        return _get_attn_isa(dtype, block_size, head_size)
