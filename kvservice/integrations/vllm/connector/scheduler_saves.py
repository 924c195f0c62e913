"""The scheduler side's part in each step: the step's metadata (`build`: the loads handed out, the waiting
hand-overs polled, the saves planned: which prompts the step finished computing and their store pages, one
Step on this node's store and one on its disk tier for the write-through), and what to unpin, commit, free or
evict once every worker rank reported its copies (`Done`).
"""

from __future__ import annotations

import logging
import time

from kvservice.blockstore.saves import admit_save, commit_save
from kvservice.integrations.vllm.connector.plan import DiskSave, Done, Load, Save, Tracked, is_disk, tier_label
from kvservice.integrations.vllm.connector.timing import ms
from kvservice.ops import EvictBlocksOp, FreeOp, OpStatus, UnpinOp

logger = logging.getLogger(__name__)


class SavePlanner:
    """SchedulerSide's save methods (it holds `tracked`, `saves_out`, `saved` and the allocator calls)."""

    def workers_done(self, done: Done) -> None:
        """Every rank reported these (vLLM added up the step's reports): unpin the loads, commit the saves all
        ranks wrote, free those a rank could not write, drop pages whose checksum failed. A RAM save that is
        being written through stays held (committed, not freed) until its disk save settles: the disk writer
        reads its pages. Sent by the teller, off the step."""
        for pin_id in done.loads:
            pool_id = self.pins_out.pop(pin_id, None)
            if pool_id is not None:
                self.teller.tell(pool_id, [UnpinOp(pin_id)])
        for pool_id, pages in done.evict.items():
            self.teller.tell(pool_id, [EvictBlocksOp(sorted(set(pages)))])
        # RAM saves before disk saves: a disk save settles after the RAM save it reads from.
        settled = sorted(set(done.saves) | set(done.failed_saves),
                         key=lambda i: is_disk(self.saves_out[i][0]) if i in self.saves_out else True)
        for save_id in settled:
            entry = self.saves_out.get(save_id)
            if entry is None:
                continue
            entry[2] += done.saves.get(save_id, 0)
            entry[3] += done.failed_saves.get(save_id, 0)
            if entry[2] + entry[3] < self.world_size:
                continue  # a rank has not reported yet
            del self.saves_out[save_id]
            pool_id, num_tokens, ok, link = entry[0], entry[1], entry[3] == 0, entry[5]
            if is_disk(pool_id):
                self.teller.tell(pool_id, commit_save(save_id, num_tokens) if ok else [FreeOp(save_id)])
                ram = self._held_for_disk.pop(save_id, None)
                if ram is not None:
                    self.teller.tell(ram[0], [FreeOp(ram[1])])  # its disk writer no longer reads it
            elif ok and link in self.saves_out:
                self.teller.tell(pool_id, commit_save(save_id, num_tokens)[:1])  # cached, still held
                self._held_for_disk[link] = (pool_id, save_id)
            else:
                self.teller.tell(pool_id, commit_save(save_id, num_tokens) if ok else [FreeOp(save_id)])

    def saving(self, req_id: str) -> bool:
        """Whether a RAM save of the request is not reported by every rank yet (its engine blocks are read)."""
        return any(entry[4] == req_id and not is_disk(entry[0]) for entry in self.saves_out.values())

    def build(self, scheduler_output) -> tuple[list[Load], list[Save]]:
        if self.handoffs:
            self._poll_handoffs()
        loads, self.pending = self.pending, []
        now = time.perf_counter()
        for load in loads:
            if load.async_load and not load.failed:
                self.handed_out[load.req_id] = (now, tier_label(load.pool_id))
        done: list[tuple[str, Tracked, int]] = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            handed = self.handed_out.pop(new.req_id, None)
            if handed is not None:  # vLLM computes it now, a step (or more) after its asynchronous load
                self.claim_parts.add(handed[1], "async_wait", now - handed[0])
                logger.debug("kvservice connector: %s computed %s after its asynchronous load was handed out",
                             new.req_id, ms(now - handed[0]))
            tracked = self.tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0]) if new.block_ids else []
                self._maybe_done(done, new.req_id, tracked, new.num_computed_tokens + num_scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            self._maybe_done(done, req_id, tracked, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0))
        saves = self._allocate_saves(done) if done and self.saves_on and self.available() else []
        return loads, saves

    def _maybe_done(self, done: list, req_id: str, tracked: Tracked, computed: int) -> None:
        """After this step the prompt's whole blocks are computed: they are saved once, unless a store gave
        them all."""
        if tracked.saved or computed < len(tracked.prompt):
            return
        tracked.saved = True
        num_tokens = len(tracked.prompt) // self.block_size * self.block_size
        # A prompt whose whole blocks were all loaded from a store's RAM is not saved again: the pages would
        # only be copied to where they already are, or replicated to this node on the step's time. Loaded from
        # a disk tier, it is saved: its pages are promoted into RAM (and are the disk's most recent too).
        if (num_tokens // self.block_size > tracked.loaded_blocks or tracked.loaded_from_disk) and self.saves_on:
            done.append((req_id, tracked, num_tokens))
            if tracked.loaded_from_disk:
                self.counters.add("promoted", tier_label(self.local_pool), tracked.loaded_blocks)

    def _allocate_saves(self, done: list[tuple[str, Tracked, int]]) -> list[Save]:
        """One Step on this node's store: per prompt a store request over its whole blocks plus one token
        (so the whole blocks can hit), admitted with delay_cache_blocks: pages it already holds come back as
        the hit, the rest are fresh pages that become hits only once the worker wrote them."""
        pool_id = self.local_pool
        ops, ids = [], []
        for req_id, tracked, num_tokens in done:
            save_id = self.next_id(req_id, "save")
            ids.append(save_id)
            ops += admit_save(save_id, tracked.prompt, num_tokens, tracked.cache_salt)
        try:
            generation = self.generation(pool_id)
            if generation is None:
                return []
            results = self.step(pool_id, ops)
        except Exception as exc:  # noqa: BLE001
            self.failed("allocating store pages", exc)
            self.teller.tell(pool_id, [FreeOp(i) for i in ids])  # in case it was applied: freed once it answers
            return []
        saves, refused, tables = [], [], []
        bs = self.block_size
        for k, (req_id, tracked, num_tokens) in enumerate(done):
            added, allocated = results[2 * k], results[2 * k + 1]
            if added.status != OpStatus.OK:
                continue
            if allocated.status != OpStatus.OK:
                refused.append(FreeOp(ids[k]))  # the store is full of pinned or in-use pages: not saved
                continue
            table = allocated.new_block_ids[0]
            start, end = allocated.num_computed_tokens // bs, num_tokens // bs
            saves.append(Save(req_id, ids[k], pool_id, generation, num_tokens, tracked.block_ids[start:end],
                              list(table[start:end]), tags=self.tags(tracked)[start:end]))
            tables.append(list(table[:end]))
            self.saves_out[ids[k]] = [pool_id, num_tokens, 0, 0, req_id, None]
            self.saved[req_id] = (pool_id, num_tokens)
            self.num_saves += 1
        self.teller.tell(pool_id, refused)  # the store is full of pinned or in-use pages: not saved
        if saves and self.local_disk() is not None:
            self._write_through(saves, tables, {req_id: tracked for req_id, tracked, _ in done})
        return saves

    def _write_through(self, saves: list[Save], tables: list[list[int]], tracked: dict[str, Tracked]) -> None:
        """One Step on this node's store's disk tier: the same prompts, admitted as there; each save's disk
        pages not there yet take their bytes from its RAM pages (`tables`: every whole block's page)."""
        pool_id = self.local_disk()
        ops, ids = [], []
        for save in saves:
            save_id = self.next_id(save.req_id, "dsave")
            ids.append(save_id)
            ops += admit_save(save_id, tracked[save.req_id].prompt, save.num_tokens, tracked[save.req_id].cache_salt)
        try:
            epoch = self.generation(pool_id)
            if epoch is None:
                return
            results = self.step(pool_id, ops)
        except Exception as exc:  # noqa: BLE001 - the RAM saves go on; the disk tier misses these
            logger.warning("kvservice connector: allocating disk pages on %s failed (%s: %s)", pool_id,
                           type(exc).__name__, exc)
            self.teller.tell(pool_id, [FreeOp(i) for i in ids])  # in case it was applied
            return
        refused, bs = [], self.block_size
        for k, save in enumerate(saves):
            added, allocated = results[2 * k], results[2 * k + 1]
            if added.status != OpStatus.OK:
                continue
            if allocated.status != OpStatus.OK:
                refused.append(FreeOp(ids[k]))  # a suspended tier, or every page pinned
                continue
            start, end = allocated.num_computed_tokens // bs, save.num_tokens // bs
            save.disk = DiskSave(ids[k], pool_id, epoch, list(allocated.new_block_ids[0][start:end]),
                                 tables[k][start:end], tags=self.tags(tracked[save.req_id])[start:end])
            self.saves_out[ids[k]] = [pool_id, save.num_tokens, 0, 0, save.req_id, save.save_id]
            self.saves_out[save.save_id][5] = ids[k]
        self.teller.tell(pool_id, refused)
