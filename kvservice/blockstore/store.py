"""`BlockStore`: one store's segment and its pool on the allocator, kept alive by the store's session."""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np

from kvservice.blockstore.disk_tier import DiskTier
from kvservice.blockstore.segment import (
    DEFAULT_DIR,
    TAG,
    Descriptor,
    Segment,
    descriptor_path,
    read_descriptor,
    write_descriptor,
)
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.errors import session_lost

logger = logging.getLogger(__name__)

LAYOUT = "kvservice-store/v1"  # the pool's kv_layout: pages of `page_bytes` (and what a pin needs declared)


def store_pool_id(name: str) -> str:
    return f"kvstore:{name}"


def store_layout(page_bytes: int) -> str:
    return f"{LAYOUT};page_bytes={page_bytes}"


class BlockStore:
    """A segment of `num_blocks` pages (page 0 is the pool's null block, never used) on this node, and the
    pool `kvstore:<name>` on the allocator at `address`, registered with a fresh epoch: a restarted store's pool
    starts empty, so no hit can name a page of the memory that went with the old process.

    The pool belongs to the tenant of `token`; only that tenant's engines can find, pin, save into or read its
    blocks (`read` and `write` check the token too, for callers that reach the store without the allocator).
    """

    def __init__(self, name: str, address: str, num_blocks: int, page_bytes: int, block_size: int, *,
                 token: str | None = None, directory: str = DEFAULT_DIR, node_id: str = "",
                 max_model_len: int = 1 << 20, watch_s: float = 1.0, tls_ca: str | None = None,
                 disk_dir: str | None = None, disk_bytes: int = 0, nixl: bool = True) -> None:
        from kvservice.client import KVServiceClient
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"name: {name!r} is not a store name (letters, digits, '-', '_', '.')")
        self.name, self.token, self.directory, self.node_id = name, token or "", directory, node_id
        self.config = KVCacheConfig(num_blocks, [FullAttentionSpec(block_size)])
        self.max_model_len, self.page_bytes, self.block_size = max_model_len, page_bytes, block_size
        self.generation = time.time_ns()
        sweep_dead(directory)
        path = os.path.join(directory, f"kvservice-store-{name}-{self.generation}")
        self.segment = Segment(path, num_blocks, page_bytes, create=True, generation=self.generation)
        self.pool_id = store_pool_id(name)
        self.num_registrations = 0
        self.disk: DiskTier | None = None
        self.nixl = None  # the segment exported through NIXL, for other nodes' engines (transports/nixl.py)
        try:
            if nixl:
                self.nixl = export_segment(self.segment, name)
            if disk_dir:
                self.disk = DiskTier(name, disk_dir, page_bytes, disk_bytes, block_size, max_model_len)
                self.disk.verify()  # before the allocator serves any of its pages again
            self.client = KVServiceClient(address, token, client_name=f"kvstore:{name}", hash_block_size=block_size,
                                          timeout_s=2.0, retries=1, tls_ca=tls_ca)
            old = _old_segment(name, directory)
            if self.disk is not None:
                self.disk.attach(self.client)
            self._register(self.generation)
        except BaseException:
            if self.nixl is not None:
                self.nixl.close()
            self.segment.close(unlink=True)
            raise
        if old is not None and old != path:
            _unlink(old, directory)  # a previous store of this name here (crashed): its pages left the index
        logger.info("store %s: %d pages of %d bytes in %s, pool %s", name, num_blocks, page_bytes, path,
                    self.pool_id)
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(watch_s,), name=f"kvstore-{name}", daemon=True)
        self._watcher.start()

    def _reopen(self) -> None:
        try:
            self.client.open_session()
        except Exception as exc:  # noqa: BLE001
            logger.info("store %s: no new session yet (%s)", self.name, exc)

    def _register(self, generation: int) -> None:
        """The pool at epoch `generation`, bound to this store's session, with its NIXL endpoint (which the
        allocator hands only to this store's tenant), and the descriptor naming it."""
        self.segment.header[0]["generation"] = generation  # first: a READ of the old epoch fails from now on
        endpoint = json.dumps(self.nixl.info()).encode() if self.nixl is not None else b""
        self.client.register_pool(self.pool_id, self.config, max_model_len=self.max_model_len, epoch=generation,
                                  kv_layout=store_layout(self.page_bytes), bound_to_session=True, endpoint=endpoint)
        self.generation = generation
        self._describe()
        self.num_registrations += 1

    def _describe(self) -> None:
        """The descriptor this node's engines read: the segment, its generation, the disk tier and its epoch, and
        the tenant the allocator knows this store's token as (`store: auto` picks its engine's tenant's store)."""
        disk = self.disk.info if self.disk is not None else None
        self.descriptor = Descriptor(self.name, self.pool_id, self.segment.path, self.segment.num_blocks,
                                     self.page_bytes, self.block_size, self.generation, self.node_id, os.getpid(),
                                     disk_dir=self.disk.directory if disk else "",
                                     disk_pool_id=disk.pool_id if disk else "", disk_epoch=disk.epoch if disk else 0,
                                     tenant=self.client.tenant)
        write_descriptor(self.descriptor, self.directory)

    def _watch(self, every_s: float) -> None:
        """Keeps the pool registered: an allocator that restarted without it, or retired it (this store's
        session lapsed while the allocator was away), gets it again at a new epoch, empty."""
        while not self._stop.wait(every_s):
            try:
                here = read_descriptor(self.name, self.directory)
                if here is not None and here.path != self.segment.path:
                    logger.warning("store %s: another store of this name started on this node (%s); this one "
                                   "stops serving its pool", self.name, here.path)
                    return
                pools = self.client.get_stats().pools
                if self.disk is not None and self.disk.ensure(self.client, pools.get(self.disk.pool_id)):
                    self._describe()  # engines write through at the disk tier's epoch
                    logger.warning("store %s: its disk tier %s re-attached at epoch %d", self.name,
                                   self.disk.pool_id, self.disk.info.epoch)
                stats = pools.get(self.pool_id)
                if stats is None or stats.epoch != self.generation:
                    generation = max(time.time_ns(), (stats.epoch + 1) if stats is not None else 0)
                    self._register(generation)
                    logger.warning("store %s: its pool was %s; registered again at epoch %d, empty", self.name,
                                   "gone" if stats is None else f"at epoch {stats.epoch}", generation)
            except Exception as exc:  # noqa: BLE001 - the allocator is away: try again
                if session_lost(exc):
                    self._reopen()
                    continue
                logger.info("store %s: the allocator did not answer (%s: %s)", self.name, type(exc).__name__, exc)

    def info(self) -> dict:
        return {"descriptor": self.descriptor.to_json(), "pool_id": self.pool_id}

    def _check_token(self, token: str | None) -> None:
        if not hmac.compare_digest((token or "").encode(), self.token.encode()):
            raise PermissionError(f"store {self.name!r}: the token does not match this store's tenant")

    def read(self, block_ids, token: str | None = None, generation: int | None = None,
             with_meta: bool = False):
        """The pages `block_ids` (the reader pinned them), for a reader on another node; `with_meta`: and their
        metadata, `(pages, meta)`, where a slice rewritten while it was read has its tag cleared (the reader
        then refuses it)."""
        self._check_token(token)
        self._check_generation(generation)
        if not with_meta:
            return np.ascontiguousarray(self.segment.read(block_ids))
        before = self.segment.read_meta(block_ids)
        pages = np.ascontiguousarray(self.segment.read(block_ids))
        after = self.segment.read_meta(block_ids)
        after[..., TAG][after[..., TAG] != before[..., TAG]] = 0
        return pages, after

    def write(self, block_ids, data: np.ndarray, token: str | None = None, generation: int | None = None) -> None:
        self._check_token(token)
        self._check_generation(generation)
        self.segment.write(block_ids, data)

    def _check_generation(self, generation: int | None) -> None:
        if generation is not None and generation != self.generation:
            raise LookupError(f"store {self.name!r} restarted (generation {self.generation}, not {generation}): "
                              f"the pages named are gone")

    def close(self) -> None:
        """Unregisters nothing (the pool stays until a new epoch replaces it), but frees the memory and removes
        the descriptor, and ends the session."""
        self._stop.set()
        self._watcher.join(timeout=10)
        self.segment.mark_closed()  # readers on this node stop using its pages at once
        if self.nixl is not None:
            self.nixl.close()  # other nodes' READs fail from now on
        try:
            self.client.close()
        finally:
            try:
                current = read_descriptor(self.name, self.directory)
                if current is not None and current.generation == self.generation:
                    descriptor_path(self.name, self.directory).unlink()
            except (FileNotFoundError, ValueError, TypeError):
                pass
            self.segment.close(unlink=True)


def export_segment(segment: Segment, name: str):
    """The segment through a NIXL agent where NIXL is installed (else None: other nodes read through Ray)."""
    from kvservice.blockstore.transports import NixlExport, nixl_available, nixl_unavailable_reason
    if not nixl_available():
        logger.info("store %s: NIXL is not available (%s): other nodes read its pages through Ray", name,
                    nixl_unavailable_reason())
        return None
    return NixlExport(segment, name, tenant="")


def sweep_dead(directory: str) -> list[str]:
    """Frees the segments of stores of this node whose process is gone (a kill -9, a node renamed): their
    memory would otherwise stay taken. Returns the names swept."""
    swept = []
    for path in Path(directory).glob("kvservice-store-*.json"):
        try:
            if path.stat().st_uid != os.getuid():
                continue  # another user's store: not ours to judge
            d = Descriptor(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        try:
            os.kill(d.pid, 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        _unlink(d.path, directory)
        _unlink(str(path), directory)
        swept.append(d.name)
    return swept


def _old_segment(name: str, directory: str) -> str | None:
    try:
        d = read_descriptor(name, directory)
    except (ValueError, TypeError):
        return None
    return d.path if d is not None else None


def _unlink(path: str, directory: str | None = None) -> None:
    """Removes a segment or descriptor file: only one of ours (`kvservice-store-*`, in `directory` when
    given), whatever a descriptor that someone else wrote names."""
    name, where = os.path.basename(path), os.path.dirname(os.path.abspath(path))
    if not name.startswith("kvservice-store-") or (directory is not None and where != os.path.abspath(directory)):
        logger.warning("not removing %s: not a store segment of %s", path, directory)
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
