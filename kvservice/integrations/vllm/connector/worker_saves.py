"""The worker side's saves: after the forward, each save's pages are copied from the engine into the store's
segment (the mover, off the step on a GPU), then sealed: checksum, format and world size of each slice, its
tag last (a reader trusts a slice only once its tag is set). A save with a disk part is then written through
to the store's disk tier by a thread of its own, durable before it is reported.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np

from kvservice.blockstore.segment import CHECKSUM, FORMAT, TAG, WORLD
from kvservice.integrations.vllm.connector.pagecheck import checksum, digest64
from kvservice.integrations.vllm.connector.plan import Save, store_name, tier_label

logger = logging.getLogger(__name__)

DISK_QUEUE = 256  # saves waiting to be written through; past it a save's write-through is dropped (reported failed)


class SaveCopies:
    """WorkerSide's save methods (it holds the mover, the stores and the `Done` report)."""

    def save(self, saves: list[Save]) -> None:
        """Submits each save's copy; a save is sealed (checksums, format, then its tag) and reported once its
        copy completed (`take_done`)."""
        for save in saves:
            try:
                if save.req_id in self.failed_requests or self.failed_blocks.intersection(save.local_block_ids):
                    raise LookupError("a load of its blocks failed (they are recomputed, not saved)")
                start = time.perf_counter()
                pages = self._slice(self.stores.writable(store_name(save.pool_id), save.generation))
                meta = self.stores.writable_meta(store_name(save.pool_id))
                if not save.store_block_ids:  # all in RAM already: nothing to copy (its disk pages still are)
                    self._seal_one((save, pages, meta), True)
                    continue
                meta[save.store_block_ids, self.rank, TAG] = 0  # being written: no reader trusts it meanwhile
                self._job += 1
                self._saving[self._job] = (save, pages, meta)
                self._saves_of.setdefault(save.req_id, set()).add(save.save_id)
                self.mover.submit_save(self._job, save.local_block_ids, pages, save.store_block_ids)
                self.copy_out_s += time.perf_counter() - start
            except Exception as exc:  # noqa: BLE001 - not saved: the scheduler side frees the pages uncached
                logger.warning("kvservice connector: saving %s into %s failed (%s: %s)", save.req_id,
                               save.pool_id, type(exc).__name__, exc)
                self._sealed(save, False)
                self._disk_failed(save)
        self._poll()

    def _disk_failed(self, save: Save) -> None:
        """A save whose write-through will not happen: reported failed (its disk pages are freed uncached)."""
        if save.disk is not None:
            with self._lock:
                failed = self._done.failed_saves
                failed[save.disk.save_id] = failed.get(save.disk.save_id, 0) + 1

    def flush_saves(self) -> None:
        """Waits for every save copy in flight (vLLM is about to reuse preempted requests' blocks)."""
        if self.mover is not None and self._saving:
            self.mover.wait(list(self._saving))
            self._poll()

    def _poll(self) -> None:
        """Seals the saves whose copies completed: at once after a synchronous copy (a CPU engine's: the
        step's report then carries them, and an offline engine that stops stepping still commits them), else
        in the sealer thread (a GPU's copies complete while the engine goes on)."""
        if self.mover is None:
            return
        for job, ok in self.mover.finished():
            entry = self._saving.pop(job, None)
            if entry is None:
                self._load_results[job] = ok
                continue
            if self.fmt.device.type == "cpu":
                self._seal_one(entry, ok)
                continue
            if self._sealer is None:
                self._sealer = threading.Thread(target=self._seal_loop, name="kvservice-sealer", daemon=True)
                self._sealer.start()
            self._seal.put((entry, ok))

    def _seal_loop(self) -> None:
        while True:
            item = self._seal.get()
            if item is None:
                return
            self._seal_one(*item)
            self._seal.task_done()

    def _seal_one(self, entry: tuple, ok: bool) -> None:
        """Checksums and format of each slice written, then its tag (its block's identity): the slice is
        whole. Then the save's write-through is queued (the RAM save stays held until it is done)."""
        save, pages, meta = entry
        try:
            if ok:
                rows = save.store_block_ids
                for row in rows:
                    meta[row, self.rank, CHECKSUM] = checksum(pages[row].numpy())
                    meta[row, self.rank, FORMAT] = self.format_digest
                    meta[row, self.rank, WORLD] = self.world_size
                tags = save.tags or [digest64(save.save_id)] * len(rows)
                meta[rows, self.rank, TAG] = np.asarray(tags, dtype=np.uint64)  # last
        except Exception as exc:  # noqa: BLE001
            logger.warning("kvservice connector: sealing %s failed (%s)", save.save_id, exc)
            ok = False
        self._sealed(save, ok)
        if save.disk is None:
            return
        if not ok:
            self._disk_failed(save)
            return
        if self._disk_writer is None:
            self._disk_writer = threading.Thread(target=self._disk_loop, name="kvservice-disk", daemon=True)
            self._disk_writer.start()
        try:
            self._disk_writes.put_nowait((save, pages, meta))
        except queue.Full:  # the disk is slower than the saves: this one is not written through
            logger.warning("kvservice connector: %d saves wait for the disk tier; %s is not written through",
                           DISK_QUEUE, save.req_id)
            self._disk_failed(save)

    def _disk_loop(self) -> None:
        """Writes saves through to the store's disk tier, off the step: each disk page takes this rank's slice
        of its RAM page, durable (fsync) before it is reported; a full disk fails that save only."""
        while True:
            item = self._disk_writes.get()
            if item is None:
                return
            save, pages, meta = item
            disk = save.disk
            label = tier_label(disk.pool_id)
            try:
                target = self.stores.disk_of(store_name(save.pool_id), disk.epoch)
                width, items = self.fmt.page_bytes, []
                tags = disk.tags or [0] * len(disk.page_ids)
                for page_id, row, tag in zip(disk.page_ids, disk.src_rows, tags):
                    # The RAM pages are held by their save until this write-through is reported; the copy is
                    # private and checked against the slice's checksum and its block's tag all the same.
                    record = np.array(meta[row, self.rank], dtype=np.uint64)
                    data = pages[row].numpy().copy()
                    if not record[TAG] or (tag and int(record[TAG]) != tag) or checksum(data) != int(record[CHECKSUM]):
                        raise LookupError(f"RAM page {row} does not hold the block it should (tag or checksum)")
                    items.append((page_id, data, record))
                target.write_slices(items, self.rank, self.rank * width)
                self.counters.add("spilled", label, len(disk.page_ids))
                self.counters.add("bytes_saved", label, len(disk.page_ids) * width)
                ok = True
            except Exception as exc:  # noqa: BLE001 - ENOSPC, a gone store: that save is freed, uncached
                logger.warning("kvservice connector: writing %s through to %s failed (%s: %s)", save.req_id,
                               disk.pool_id, type(exc).__name__, exc)
                ok = False
            with self._lock:
                box = self._done.saves if ok else self._done.failed_saves
                box[disk.save_id] = box.get(disk.save_id, 0) + 1
            self._disk_writes.task_done()

    def _sealed(self, save: Save, ok: bool) -> None:
        with self._lock:
            box = self._done.saves if ok else self._done.failed_saves
            box[save.save_id] = box.get(save.save_id, 0) + 1
            if ok:
                self.num_saved_blocks += len(save.store_block_ids)
                self.counters.add("saved", tier_label(save.pool_id), len(save.store_block_ids))
                self.counters.add("bytes_saved", tier_label(save.pool_id),
                                  len(save.store_block_ids) * self.fmt.page_bytes)
            pending = self._saves_of.get(save.req_id)
            if pending is not None:
                pending.discard(save.save_id)
                if not pending:
                    del self._saves_of[save.req_id]
