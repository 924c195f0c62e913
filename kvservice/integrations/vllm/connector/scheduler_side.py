"""The connector's scheduler side (vLLM's EngineCore process): finds and pins a new request's prefix in the
store tier, and allocates store pages for the prompts the engine computed.

Calls to the allocator, per scheduler step: none for a new request that no store holds more of than the
engine (hits are found in a replica of the store pools' prefix index, kvservice.client.PrefixIndex, kept from
the allocator's events), else one Step that pins on the store with the longest hit; one Step for all the
saves the step asks for. With `index` off, one Lookup RPC per new request as well. Copies are the worker
side's; once every worker rank reported a load or a save (`Done`, vLLM's worker metadata, added up over the
ranks), this side unpins or commits it, in a thread of its own (teller.py). A failed call turns sharing off
for `retry_after_s`: requests are then computed, never answered from memory that may be gone.

Its parts: finding and pinning hits, and the request's life (this file); each step's metadata and what the
workers reported (scheduler_saves.py); the prefill/decode hand-over (scheduler_handover.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from kvservice.hashing import hash_prompt
from kvservice.integrations.vllm.connector.counters import Counters
from kvservice.integrations.vllm.connector.link import AllocatorLink
from kvservice.integrations.vllm.connector.plan import (
    Handoff,
    Hit,
    Load,
    Tracked,
    block_tags,
    is_disk,
    is_store_pool,
    tier_label,
)
from kvservice.integrations.vllm.connector.scheduler_handover import HandoverWaits
from kvservice.integrations.vllm.connector.scheduler_saves import SavePlanner
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.timing import Parts, ms
from kvservice.ops import OpStatus, PinOp, UnpinOp

logger = logging.getLogger(__name__)

LOADED_KEPT = 4096


class SchedulerSide(HandoverWaits, SavePlanner, AllocatorLink):
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
        self.claim_parts = Parts()  # lookup, pin, async_wait and commit seconds per tier (timing.py)
        self.handed_out: dict[str, tuple[float, str]] = {}  # async load's request -> (handed out at, tier)
        self.teller.on_sent = self._told
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
            if claimed and self._handoff_now(req_id, tracked, num_computed_tokens, claimed):
                return claimed, False  # committed already: loaded in this step, not a step later
            return claimed, claimed > 0  # vLLM takes an asynchronous answer only for a positive count
        try:
            return self._pin(req_id, tracked, num_computed_tokens), False
        except Exception as exc:  # noqa: BLE001 - any failure: compute instead
            self.failed("a store lookup", exc)
            return 0, False

    def _pin(self, req_id: str, tracked: Tracked, num_computed_tokens: int) -> int:
        self.num_lookups += 1
        t0 = time.perf_counter()
        found = self.find(tracked)
        # A disk tier is read on its store's node only: another node's disk hits are not this engine's.
        hits = [h for h in found.hits if h.num_cached_tokens > num_computed_tokens and is_store_pool(h.pool_id)
                and (not is_disk(h.pool_id) or h.pool_id == self.local_disk())]
        t1 = time.perf_counter()
        if not hits:
            self.claim_parts.add("", "lookup", t1 - t0)
            return 0
        best = max(hits, key=lambda h: (h.num_cached_tokens, self.rank(h.pool_id)))
        hit = self._pin_on(best.pool_id, req_id, tracked, num_computed_tokens)
        t2 = time.perf_counter()
        label = tier_label(best.pool_id)
        self.claim_parts.add(label, "lookup", t1 - t0)
        self.claim_parts.add(label, "pin", t2 - t1)
        logger.debug("kvservice connector: %s: lookup %s, pin on %s %s: %s tokens", req_id, ms(t1 - t0),
                     best.pool_id, ms(t2 - t1), hit.num_tokens - num_computed_tokens if hit else "none")
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

    def _told(self, pool_id: str, ops: list, seconds: float) -> None:
        """The teller sent a Step: its unpins are the commit back of loads (`commit`, per unpin)."""
        unpins = sum(isinstance(op, UnpinOp) for op in ops)
        if unpins:
            self.claim_parts.add(tier_label(pool_id), "commit", seconds * unpins, unpins)
            logger.debug("kvservice connector: %d unpin(s) on %s answered %s after the workers reported", unpins,
                         pool_id, ms(seconds))

    def _unpin(self, hit: Hit) -> None:
        self.teller.tell(hit.pool_id, [UnpinOp(hit.pin_id)])

    # ---- the request's life ----------------------------------------------------------------------
    def delay(self, req_id: str) -> None:
        """vLLM keeps the finished request's blocks until the workers report it (told in the next metadata)."""
        self.delayed.append(req_id)

    def take_delayed(self) -> list[str]:
        delayed, self.delayed = self.delayed, []
        return delayed

    def has_pending_work(self) -> bool:
        """Loads, saves or hand-overs not settled yet: vLLM keeps stepping (so the workers report them)."""
        return bool(self.pins_out or self.saves_out or self.handoffs or self.delayed)

    def finished(self, request) -> dict | None:
        """vLLM finished the request (aborts included); returns its kv_transfer_params."""
        req_id = request.request_id
        self.tracked.pop(req_id, None)
        self.handed_out.pop(req_id, None)
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
