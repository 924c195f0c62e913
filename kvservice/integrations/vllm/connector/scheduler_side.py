"""The connector's scheduler side (vLLM's EngineCore process): finds and pins a new request's prefix in the
store tier, and allocates store pages for the prompts the engine computed.

Calls to the allocator, per scheduler step: none for a new request that no store holds more of than the
engine (hits are found in a replica of the store pools' prefix index, kvservice.client.PrefixIndex, kept from
the allocator's events), else one Step that pins on the store with the longest hit; one Step for all the
saves the step asks for. With `index` off, one Lookup RPC per new request as well. Copies are the worker
side's; once every worker rank reported a load or a save (`Done`, vLLM's worker metadata, added up over the
ranks), this side unpins or commits it, in a thread of its own (teller.py). A failed call turns sharing off
for `retry_after_s`: requests are then computed, never answered from memory that may be gone.

Prefill/decode hand-over: a producer's finished request returns `kv_transfer_params` naming its save; a
consumer given them waits for the pages (an asynchronous load, vLLM's WAITING_FOR_REMOTE_KVS) until they are
committed, instead of finding nothing because it asked a moment too early.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from kvservice.blockstore.saves import admit_save, commit_save
from kvservice.hashing import hash_prompt
from kvservice.integrations.vllm.connector.counters import Counters
from kvservice.integrations.vllm.connector.link import AllocatorLink
from kvservice.integrations.vllm.connector.plan import (
    STORE_PREFIX,
    DiskSave,
    Done,
    Handoff,
    Hit,
    Load,
    Save,
    Tracked,
    block_tags,
    is_disk,
    is_store_pool,
    tier_label,
)
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.ops import EvictBlocksOp, FreeOp, OpStatus, PinOp, UnpinOp

logger = logging.getLogger(__name__)

LOADED_KEPT = 4096
HANDOFF_POLL_S = 0.02  # a waiting hand-over asks for its pages at most this often
PARAMS_KEY = "kvservice"  # in kv_transfer_params


class SchedulerSide(AllocatorLink):
    def __init__(self, settings: ConnectorSettings, block_size: int, engine_id: str, *, loads: bool,
                 saves: bool, namespace: str = "", world_size: int = 1) -> None:
        super().__init__(settings, block_size, engine_id)
        # Salted into every prompt's hashes: engines of another model, dtype or layout never share pages.
        self.namespace = settings.namespace or namespace
        self.loads_on, self.saves_on = loads, saves and settings.store is not None
        self.hits: dict[str, Hit] = {}  # request id -> its pinned, not yet loaded prefix
        self.pending: list[Load] = []  # loads for the next metadata
        self.tracked: dict[str, Tracked] = {}
        # request id -> the tokens its last admission loaded (stats, tests): the latest LOADED_KEPT requests
        self.loaded: OrderedDict[str, int] = OrderedDict()
        self.num_pins = self.num_saves = self.num_lookups = 0
        self.world_size = world_size  # the worker ranks that must report a load or a save
        self.counters = Counters()
        self.pins_out: dict[str, str] = {}  # pin id -> pool: loads handed to the workers, not reported yet
        # save id -> [pool, num_tokens, ranks written, ranks failed, request, the linked RAM/disk save id]
        self.saves_out: dict[str, list] = {}
        self._held_for_disk: dict[str, tuple[str, str]] = {}  # disk save -> (RAM pool, RAM save) it reads
        self.delayed: list[str] = []  # finished requests vLLM keeps the blocks of, for the next metadata
        self.saved: dict[str, tuple[str, int]] = {}  # request id -> (pool, tokens) it saved (kv_transfer_params)
        self.handoffs: dict[str, Handoff] = {}  # request id -> a hand-over it waits for
        if loads and settings.index:
            try:  # now, so the replica has synced by the first request (else it starts on first use)
                self.index()
            except Exception as exc:  # noqa: BLE001 - the allocator away at start-up: the engine starts all the same
                self.failed("starting the prefix-index replica", exc)

    def session_lost(self) -> None:
        self.hits.clear()  # their pins went with the session

    def tags(self, tracked: Tracked) -> list[int]:
        """The prompt's whole blocks' page tags (block_tags), computed once."""
        if tracked.tags is None:
            tracked.tags = block_tags(hash_prompt(tracked.prompt, self.block_size, cache_salt=tracked.cache_salt))
        return tracked.tags

    # ---- loads ---------------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        if request.mm_features or request.lora_request is not None or getattr(request, "prompt_embeds", None) \
                is not None:
            return  # multimodal, LoRA and embedding prompts are neither saved nor loaded (their ids say too little)
        salt = getattr(request, "cache_salt", None)
        tracked = Tracked(list(request.prompt_token_ids or ()),
                          f"{self.namespace}|{salt}" if salt else self.namespace or None)
        tracked.handoff = self._handoff_of(request)
        self.tracked[request.request_id] = tracked

    def _handoff_of(self, request) -> Handoff | None:
        """The hand-over a request's kv_transfer_params name (they come from a client: anything else than a
        store pool and a positive whole number of tokens is ignored, with a warning)."""
        params = getattr(request, "kv_transfer_params", None)
        params = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if params is None:
            return None
        pool_id, num_tokens = params.get("pool_id") if isinstance(params, dict) else None, \
            params.get("num_tokens") if isinstance(params, dict) else None
        if not (isinstance(pool_id, str) and pool_id.startswith(STORE_PREFIX) and isinstance(num_tokens, int)
                and not isinstance(num_tokens, bool) and num_tokens > 0):
            logger.warning("kvservice connector: request %s: kv_transfer_params %r name no store pool and token "
                           "count; ignored", request.request_id, params)
            return None
        return Handoff(pool_id, num_tokens, time.monotonic() + self.settings.handoff_timeout_s)

    def num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past the engine's own hit a store holds, pinned for this request (whole blocks); whether vLLM
        must wait for them: a hand-over whose pages may not be committed yet)."""
        req_id = request.request_id
        hit = self.hits.get(req_id)
        if hit is not None:  # asked again (not admitted last time): the engine's own hit may have changed
            hit.num_computed_tokens = num_computed_tokens
            return max(0, hit.num_tokens - num_computed_tokens), False
        tracked = self.tracked.get(req_id)
        if not self.loads_on or tracked is None or not self.available():
            return 0, False
        prompt = tracked.prompt
        if len(prompt) - 1 < num_computed_tokens + self.block_size:
            return 0, False  # not a block more to find than the engine has
        if tracked.handoff is not None:
            claimed = self._await_handoff(req_id, tracked, num_computed_tokens)
            return claimed, claimed > 0  # vLLM takes an asynchronous answer only for a positive count
        try:
            return self._pin(req_id, tracked, num_computed_tokens), False
        except Exception as exc:  # noqa: BLE001 - any failure: compute instead
            self.failed("a store lookup", exc)
            return 0, False

    def _pin(self, req_id: str, tracked: Tracked, num_computed_tokens: int) -> int:
        self.num_lookups += 1
        found = self.find(tracked)
        # A disk tier is read on its store's node only: another node's disk hits are not this engine's.
        hits = [h for h in found.hits if h.num_cached_tokens > num_computed_tokens and is_store_pool(h.pool_id)
                and (not is_disk(h.pool_id) or h.pool_id == self.local_disk())]
        if not hits:
            return 0
        best = max(hits, key=lambda h: (h.num_cached_tokens, self.rank(h.pool_id)))
        hit = self._pin_on(best.pool_id, req_id, tracked, num_computed_tokens)
        if hit is None:
            return 0
        self.hits[req_id] = hit
        self.counters.add("claimed", tier_label(hit.pool_id))
        self.counters.add("claimed_tokens", tier_label(hit.pool_id), hit.num_tokens - num_computed_tokens)
        return hit.num_tokens - num_computed_tokens

    def _pin_on(self, pool_id: str, req_id: str, tracked: Tracked, num_computed_tokens: int) -> Hit | None:
        """One PinOp: the prompt's cached prefix on `pool_id`, pinned, if it has more than the engine."""
        generation = self.generation(pool_id)
        if generation is None:
            return None
        pin_id = self.next_id(req_id, "pin")
        try:
            (r,) = self.step(pool_id, [PinOp(pin_id, token_ids=tracked.prompt, cache_salt=tracked.cache_salt)])
        except Exception:
            self.teller.tell(pool_id, [UnpinOp(pin_id)])  # it may have been applied: released once it answers
            raise
        if r.status != OpStatus.OK or not r.new_block_ids:
            return None  # evicted since the lookup: nothing pinned
        self.num_pins += 1
        hit = Hit(pool_id, pin_id, generation, r.num_computed_tokens, list(r.new_block_ids[0]), num_computed_tokens)
        if hit.num_tokens <= num_computed_tokens:
            self.step(pool_id, [UnpinOp(pin_id)])
            return None
        return hit

    def _await_handoff(self, req_id: str, tracked: Tracked, num_computed_tokens: int) -> int:
        """A hand-over: the whole blocks the producer saves (never the whole prompt), claimed now and loaded
        once committed."""
        handoff = tracked.handoff
        end = min(handoff.num_tokens, (len(tracked.prompt) - 1) // self.block_size * self.block_size)
        handoff.num_computed_tokens = num_computed_tokens
        handoff.claimed = max(0, end - num_computed_tokens)
        if handoff.claimed:
            self.counters.add("claimed", tier_label(handoff.pool_id))
            self.counters.add("claimed_tokens", tier_label(handoff.pool_id), handoff.claimed)
        return handoff.claimed

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: a positive answer becomes a load into them."""
        req_id = request.request_id
        tracked = self.tracked.get(req_id)
        if tracked is not None and tracked.handoff is not None and num_external_tokens > 0:
            tracked.handoff.block_ids = list(block_ids)
            tracked.handoff.claimed = num_external_tokens
            self.handoffs[req_id] = tracked.handoff
            return
        hit = self.hits.pop(req_id, None)
        if hit is None:
            return
        if num_external_tokens <= 0:
            self._unpin(hit)  # vLLM took none of it (skip_reading_prefix_cache, a capped hit)
            return
        self._note_loaded(req_id, num_external_tokens)
        # The engine's own hit, then the external tokens vLLM took (all of the answer, or less when capped).
        start = hit.num_computed_tokens // self.block_size
        end = min(hit.num_tokens, hit.num_computed_tokens + num_external_tokens) // self.block_size
        if tracked is not None:
            tracked.loaded_blocks = end
            tracked.loaded_from_disk = is_disk(hit.pool_id)
        self._hand_out(Load(req_id, hit.pool_id, hit.pin_id, hit.generation, hit.store_block_ids[start:end],
                            list(block_ids[start:end]), tags=self.tags(tracked)[start:end] if tracked else []))

    def _note_loaded(self, req_id: str, num_tokens: int) -> None:
        self.loaded[req_id] = num_tokens
        if len(self.loaded) > LOADED_KEPT:
            self.loaded.popitem(last=False)

    def _hand_out(self, load: Load) -> None:
        self.pending.append(load)
        if load.pin_id:
            self.pins_out[load.pin_id] = load.pool_id

    def _unpin(self, hit: Hit) -> None:
        self.teller.tell(hit.pool_id, [UnpinOp(hit.pin_id)])

    def _poll_handoffs(self) -> None:
        """Each waiting hand-over asks for its pages (a PinOp); pinned, or past its deadline, it becomes an
        asynchronous load (a failed one: vLLM recomputes the blocks)."""
        now = time.monotonic()
        for req_id, handoff in list(self.handoffs.items()):
            if now < handoff.next_try:
                continue
            handoff.next_try = now + HANDOFF_POLL_S
            tracked = self.tracked.get(req_id)
            start = handoff.num_computed_tokens // self.block_size
            end = (handoff.num_computed_tokens + handoff.claimed) // self.block_size
            hit = None
            if tracked is not None and self.available():
                try:
                    hit = self._pin_on(handoff.pool_id, req_id, tracked, handoff.num_computed_tokens)
                except Exception as exc:  # noqa: BLE001 - asked again until the deadline
                    self.failed("pinning a hand-over", exc)
            if hit is not None and hit.num_tokens >= handoff.num_computed_tokens + handoff.claimed:
                del self.handoffs[req_id]
                self._note_loaded(req_id, handoff.claimed)
                if tracked is not None:
                    tracked.loaded_blocks = end
                self._hand_out(Load(req_id, hit.pool_id, hit.pin_id, hit.generation, hit.store_block_ids[start:end],
                                    handoff.block_ids[start:end], async_load=True,
                                    tags=self.tags(tracked)[start:end]))
                continue
            if hit is not None:
                self._unpin(hit)  # a part of it: wait for the whole save
            if now >= handoff.deadline:
                del self.handoffs[req_id]
                logger.warning("kvservice connector: the hand-over of %s from %s was not committed within %.1f s; "
                               "vLLM recomputes it", req_id, handoff.pool_id, self.settings.handoff_timeout_s)
                self.pending.append(Load(req_id, handoff.pool_id, "", 0, [], handoff.block_ids[start:end],
                                         async_load=True, failed="timeout"))

    # ---- what the workers did ------------------------------------------------------------------
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

    def delay(self, req_id: str) -> None:
        """vLLM keeps the finished request's blocks until the workers report it (told in the next metadata)."""
        self.delayed.append(req_id)

    def take_delayed(self) -> list[str]:
        delayed, self.delayed = self.delayed, []
        return delayed

    def has_pending_work(self) -> bool:
        """Loads, saves or hand-overs not settled yet: vLLM keeps stepping (so the workers report them)."""
        return bool(self.pins_out or self.saves_out or self.handoffs or self.delayed)

    def request_params(self, request) -> dict | None:
        """The `kv_transfer_params` of a finished request that saved its prompt: a consumer given them waits
        for those pages."""
        saved = self.saved.pop(request.request_id, None)
        if saved is None:
            return None
        pool_id, num_tokens = saved
        return {PARAMS_KEY: {"pool_id": pool_id, "num_tokens": num_tokens}}

    # ---- saves ---------------------------------------------------------------------------------
    def build(self, scheduler_output) -> tuple[list[Load], list[Save]]:
        if self.handoffs:
            self._poll_handoffs()
        loads, self.pending = self.pending, []
        done: list[tuple[str, Tracked, int]] = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
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

    def finished(self, request) -> dict | None:
        """vLLM finished the request (aborts included); returns its kv_transfer_params."""
        req_id = request.request_id
        self.tracked.pop(req_id, None)
        handoff = self.handoffs.pop(req_id, None)
        if handoff is not None:  # aborted while it waited: vLLM frees it once the workers report the load ended
            self.pending.append(Load(req_id, handoff.pool_id, "", 0, [], [], async_load=True, failed="aborted"))
        hit = self.hits.pop(req_id, None)
        if hit is not None:  # pinned, never loaded
            self._unpin(hit)
        return self.request_params(request)

    def close(self) -> None:
        self.teller.flush()
        self.teller.close()
        if self._index is not None:
            self._index.close()
        if self._client is not None:
            self._client.close()
