"""Prefill/decode hand-over, the scheduler side's part: a producer's finished request returns
`kv_transfer_params` naming its save; a consumer given them claims the blocks at once and waits for the pages
(an asynchronous load, vLLM's WAITING_FOR_REMOTE_KVS) until they are committed, instead of finding nothing
because it asked a moment too early. Past `handoff_timeout_s` the load fails and vLLM recomputes the blocks.
"""

from __future__ import annotations

import logging
import time

from kvservice.integrations.vllm.connector.plan import STORE_PREFIX, Handoff, Load, Tracked, tier_label

logger = logging.getLogger(__name__)

HANDOFF_POLL_S = 0.02  # a waiting hand-over asks for its pages at most this often
PARAMS_KEY = "kvservice"  # in kv_transfer_params


class HandoverWaits:
    """SchedulerSide's hand-over methods (it holds `tracked`, `handoffs`, `saved` and the pinning calls)."""

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

    def _handoff_now(self, req_id: str, tracked: Tracked, num_computed_tokens: int, claimed: int) -> bool:
        """One PinOp: when the producer's pages are committed already, the hand-over becomes a plain pinned hit,
        loaded synchronously before this step's forward (an asynchronous load would make vLLM compute the
        request a step later). False: not (wholly) there yet, it waits as a hand-over."""
        try:
            t0 = time.perf_counter()
            hit = self._pin_on(tracked.handoff.pool_id, req_id, tracked, num_computed_tokens)
            self.claim_parts.add(tier_label(tracked.handoff.pool_id), "pin", time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - it waits, and asks again
            self.failed("pinning a hand-over", exc)
            return False
        if hit is None:
            return False
        if hit.num_tokens < num_computed_tokens + claimed:
            self._unpin(hit)  # a part of it: wait for the whole save
            return False
        hit.num_tokens = num_computed_tokens + claimed  # what was claimed, never more (never the whole prompt)
        tracked.handoff = None
        self.hits[req_id] = hit
        return True

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

    def request_params(self, request) -> dict | None:
        """The `kv_transfer_params` of a finished request that saved its prompt: a consumer given them waits
        for those pages."""
        saved = self.saved.pop(request.request_id, None)
        if saved is None:
            return None
        pool_id, num_tokens = saved
        return {PARAMS_KEY: {"pool_id": pool_id, "num_tokens": num_tokens}}
