"""The driver: a continuous-batching scheduler whose KV memory is managed by the allocator service.

    Engine.step: _plan (StepPlan: forks, frees, prefill chunks, decodes, admissions under a token budget)
      -> one allocator Step RPC -> readers (rows, copies, preemptions) -> StepBatch -> every rank -> sampling
`NO_SPACE` preempts a request (freed, recomputed later); prefix-cache hits skip their prefill; parallel
sampling forks the prompt (copy-on-write).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvservice.client import KVServiceClient
from kvservice.core import KVCacheConfig, SlidingWindowSpec
from kvservice.ops import OpStatus
from worker.batch import RowUpdate, StepBatch
from worker.engine_config import EngineConfig, EngineStats, KVCacheSpec
from worker.request import EngineRequest, RequestState
from worker.sampling import SamplingParams, sample
from worker.step_plan import Growth, StepPlan, StepReplies, batch_growths, growth

__all__ = ["Engine", "EngineConfig", "EngineStats", "KVCacheSpec", "Workers"]


class Workers(Protocol):
    """The ranks of one pool: every rank executes the same batch; logits come back once."""

    def execute(self, batch: StepBatch) -> torch.Tensor: ...


@dataclass(slots=True)
class _StepWork:
    """What the readers gather from a reply: the workers' row edits and the tokens each request runs."""

    updates: list[RowUpdate] = field(default_factory=list)
    scheduled: list[tuple[EngineRequest, int, int]] = field(default_factory=list)  # (request, start, count)


class Engine:
    def __init__(self, client: KVServiceClient, workers: Workers, config: EngineConfig,
                 record_logits: bool = False, peers: dict[str, Workers] | None = None) -> None:
        self.client = client
        self.workers = workers
        self.config = config
        self.peers = peers if peers is not None else {}  # other pools' workers, for transfers
        self.record_logits = record_logits
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.finished: list[EngineRequest] = []
        self._frees: list[EngineRequest] = []  # the allocator holds them; FreeOps go with the next step
        self._forks: list[tuple[EngineRequest, EngineRequest]] = []
        self._free_rows = list(range(config.max_num_rows - 1, -1, -1))
        self._clear_rows: list[int] = []
        self._ids = itertools.count()
        self._seeds = itertools.count(1 << 32)  # for requests that bring no seed
        self.stats = EngineStats()
        self._transfers: list = []
        self.registration = self._register()

    def _register(self):
        """Registers the pool at the configured epoch (its config, hash spec and KV layout)."""
        cfg = self.config
        return self.client.register_pool(
            cfg.pool_id, KVCacheConfig(cfg.num_blocks, list(cfg.groups)), cfg.max_model_len,
            epoch=cfg.epoch, dcp_world_size=cfg.dcp_world_size, enable_caching=cfg.enable_prefix_caching,
            kv_layout=cfg.kv_layout or f"block={cfg.block_size};dcp={cfg.dcp_world_size}")

    def restart_pool(self, workers: Workers) -> None:
        """The workers died (their KV memory is gone): register a new epoch with fresh workers. The
        allocator fails the pool's requests; they are recomputed from their tokens."""
        self.workers = workers
        self.config.epoch += 1
        self.registration = self._register()
        orphans = [child for _, child in self._forks if not child.finished]
        for req in [*self.running, *orphans]:
            req.reset()
            req.row = None
            req.parent = None if req in orphans else req.parent
            req.num_preemptions += 1
            self.waiting.appendleft(req)
        self.running, self._frees, self._forks, self._transfers, self._clear_rows = [], [], [], [], []
        self._free_rows = list(range(self.config.max_num_rows - 1, -1, -1))

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> EngineRequest:
        params = params or SamplingParams()
        if not prompt or len(prompt) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} must fit "
                             f"max_model_len {self.config.max_model_len}")
        seed = params.seed if params.seed is not None else next(self._seeds)
        req = EngineRequest(request_id or f"req-{next(self._ids)}", list(prompt), len(prompt), params, seed,
                            children_pending=params.n - 1)
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._frees or self._forks)

    def run(self, max_steps: int = 1_000_000, progress=None) -> list[EngineRequest]:
        start = time.perf_counter()
        while self.has_unfinished() and self.stats.steps < max_steps:
            self.step()
            if progress is not None:
                progress(self)
        self.stats.total_s += time.perf_counter() - start
        return self.finished

    # ---- one scheduler step --------------------------------------------------------------------
    def step(self) -> None:
        self.stats.steps += 1
        plan = self._plan()
        t0 = time.perf_counter()
        result = self.client.step(self.config.pool_id, plan.ops())
        self.stats.allocator_s += time.perf_counter() - t0
        batch, scheduled = self._read(plan, plan.replies(result))
        if batch is None:
            return
        transfers, self._transfers = self._transfers, []
        t0 = time.perf_counter()
        for order in transfers:  # copied before this step writes any K/V
            self.peers[order.src_pool_id].transfer_to(self.workers, order.src_block_ids, order.dst_block_ids)
        self.stats.transfer_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = self.workers.execute(batch)
        self.stats.model_s += time.perf_counter() - t0
        for order in transfers:
            self.client.commit_transfer(self.config.pool_id, order.transfer_id)
        self._sample(scheduled, logits)

    def _plan(self) -> StepPlan:
        """Running requests first (a decode token each, or the next prefill chunk), then admissions in
        arrival order, while the token budget and `max_num_seqs` allow."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        plan = StepPlan(forks=self._forks, frees=self._frees)
        self._frees, self._forks = [], []
        for req in self.running:
            remaining = len(req.tokens) - req.num_computed
            if budget <= 0 or remaining <= 0:
                continue
            if req.num_sent == len(req.tokens) - 1:  # decode: send the sampled token, compute it
                plan.decodes.append(req)
                budget -= 1
            else:
                n = min(remaining, budget)
                plan.chunks.append((req, n))
                budget -= n
        num_running = len(self.running) + len(plan.forks)
        while self.waiting and budget > 0 and num_running < cfg.max_num_seqs:
            req = self.waiting.popleft()
            req.num_sent = len(req.tokens)
            transfer = cfg.allow_transfers and not req.no_transfer
            # At most the whole request: its cached prefix is not known yet (the allocator schedules
            # what is left after the hit).
            n = min(budget, len(req.tokens))
            (plan.transfer_admissions if transfer else plan.admissions).append((req, n))
            budget -= n
            num_running += 1
        return plan

    def _read(self, plan: StepPlan, replies: StepReplies) -> tuple[StepBatch | None, list[EngineRequest]]:
        """Reads the allocator's reply: which tokens run, block-table changes, copies, preemptions."""
        work = _StepWork()
        num_groups = len(self.config.groups)
        self._release_rows(plan.frees)
        self._read_forks(plan.forks, replies, work)
        if replies.decode is not None:
            for req, g in zip(plan.decodes, batch_growths(replies.decode)):
                if g.status == OpStatus.OK:
                    req.num_sent += 1
                self._read_growth(req, g, work)
        for (req, _), r in zip(plan.chunks, replies.chunks):
            self._read_growth(req, growth(r, num_groups), work)
        requeue: list[EngineRequest] = []
        if replies.admit is not None:
            for (req, _), g in zip(plan.admissions, batch_growths(replies.admit)):
                self._read_admission(req, g, work, requeue)
        for (req, _), r in zip(plan.transfer_admissions, replies.transfer_admissions):
            self._read_admission(req, growth(r, num_groups), work, requeue)
        if requeue and self._alone(requeue):
            self._never_fits(requeue[0])
        self.waiting.extendleft(reversed(requeue))  # retried first, in arrival order
        self.stats.copies += len(replies.copies)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        held = {b for r in self.running for table in r.tables for b in table if b}
        self.stats.peak_blocks = max(self.stats.peak_blocks, len(held))
        if not work.scheduled and not work.updates and not self._clear_rows:
            return None, []
        return self._batch(work, replies.copies)

    def _release_rows(self, freed: list[EngineRequest]) -> None:
        for req in freed:
            if req.row is not None:
                self._clear_rows.append(req.row)
                self._free_rows.append(req.row)
                req.row = None

    def _read_forks(self, forks: list[tuple[EngineRequest, EngineRequest]], replies: StepReplies,
                    work: _StepWork) -> None:
        for (parent, child), r in zip(forks, replies.forks):
            if r.status != OpStatus.OK:
                raise RuntimeError(f"fork of {parent.request_id} failed: {r.status.name} {r.message}")
            child.tables = [list(ids) for ids in r.new_block_ids]
            self.stats.forks += 1
            if child.finished:  # it sampled its last token already; freed in this same step
                continue
            child.state = RequestState.RUNNING
            child.row = self._free_rows.pop()
            work.updates.append(RowUpdate(child.row, set_blocks=[list(t) for t in child.tables]))
            self.running.append(child)

    def _read_growth(self, req: EngineRequest, g: Growth, work: _StepWork) -> None:
        """A running request's decode token or prefill chunk: its row grows, or it is preempted."""
        if g.status != OpStatus.OK:
            self._preempt(req, g.status)
            return
        self._drop_skipped(req, g.start)
        for group, index, block_id in g.replaced:
            req.tables[group][index] = block_id
        for table, new in zip(req.tables, g.new_blocks):
            table += new
        if any(g.new_blocks) or g.replaced:
            work.updates.append(RowUpdate(req.row, append_blocks=[list(b) for b in g.new_blocks],
                                          replace=list(g.replaced)))
        work.scheduled.append((req, g.start, g.count))

    def _drop_skipped(self, req: EngineRequest, num_computed: int) -> None:
        """Mirrors the allocator freeing the blocks a sliding window no longer reads (they become null in
        its table before it allocates). Only the mirror changes: the workers' rows keep the old ids,
        which attention never reads again."""
        for spec, table in zip(self.config.groups, req.tables):
            if isinstance(spec, SlidingWindowSpec):
                skipped = max(0, num_computed - spec.sliding_window + 1) // spec.block_size
                table[:skipped] = [0] * min(skipped, len(table))

    def _read_admission(self, req: EngineRequest, g: Growth, work: _StepWork, requeue: list[EngineRequest]) -> None:
        """A waiting request's first allocation: a row with its whole table, or back to the queue."""
        if g.status == OpStatus.NO_SPACE:
            self._frees.append(req)  # the allocator added it: free it, admit it again from its tokens
            requeue.append(req)
            return
        if g.status != OpStatus.OK:
            raise RuntimeError(f"admission of {req.request_id} failed: {g.status.name} {g.message}")
        if g.transfer is not None and g.transfer.src_pool_id not in self.peers:
            # We cannot reach the source pool's workers: give the order back (the allocator frees the
            # request) and recompute.
            self.client.commit_transfer(self.config.pool_id, g.transfer.transfer_id, abort=True)
            req.no_transfer = True
            requeue.append(req)
            return
        req.state = RequestState.RUNNING
        req.num_computed = g.start
        if g.transfer is not None:
            self._transfers.append(g.transfer)
            req.transferred_tokens = len(g.transfer.dst_block_ids) * self._tokens_per_block
            self.stats.transfers += 1
            self.stats.transferred_tokens += req.transferred_tokens
        if req.hit_tokens < 0:
            req.hit_tokens = g.start
            req.admitted_at = time.perf_counter()
            self.stats.prompt_tokens += req.num_prompt_tokens
            self.stats.hit_tokens += g.start
        req.tables = [list(b) for b in g.new_blocks]
        req.row = self._free_rows.pop()
        work.updates.append(RowUpdate(req.row, set_blocks=[list(t) for t in req.tables]))
        self.running.append(req)
        work.scheduled.append((req, g.start, g.count))

    def _batch(self, work: _StepWork, copies: list[tuple[int, int]]) -> tuple[StepBatch, list[EngineRequest]]:
        """The workers' batch of the scheduled tokens, and the requests whose last token runs (they sample)."""
        input_ids, positions, rows, qsl, seq_lens, logits_indices = [], [], [], [0], [], []
        needs_logits = []
        for req, start, count in work.scheduled:
            input_ids += req.tokens[start:start + count]
            positions += range(start, start + count)
            rows.append(req.row)
            qsl.append(qsl[-1] + count)
            seq_lens.append(start + count)
            req.num_computed = start + count
            if start + count == len(req.tokens):
                logits_indices.append(qsl[-1] - 1)
                needs_logits.append(req)
            self.stats.computed_tokens += count
        batch = StepBatch(self._clear_rows, work.updates, list(copies), input_ids, positions, rows, qsl, seq_lens,
                          logits_indices)
        self._clear_rows = []
        return batch, needs_logits

    def _preempt(self, req: EngineRequest, status: OpStatus) -> None:
        """No room (or the pool's memory is gone): free it and recompute it later from its tokens."""
        if status not in (OpStatus.NO_SPACE, OpStatus.EPOCH_CHANGED):
            raise RuntimeError(f"{req.request_id}: unexpected {status.name}")
        if status == OpStatus.NO_SPACE and self._alone([req]):
            self._never_fits(req)
        self.running.remove(req)
        if status == OpStatus.NO_SPACE:
            self._frees.append(req)  # the allocator still holds it; its row is released with the free
        else:
            self._release_rows([req])
        req.reset()
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _alone(self, refused: list[EngineRequest]) -> bool:
        """Whether nothing but `refused` held blocks when the allocator refused them (this step's frees
        had applied; requests preempted in this step still held theirs)."""
        return (not self._forks and all(r in refused for r in self.running)
                and all(r in refused for r in self._frees))

    def _never_fits(self, req: EngineRequest) -> None:
        """Refused with nothing else holding blocks: retrying would loop forever."""
        cfg = self.config
        raise RuntimeError(f"request {req.request_id} ({len(req.tokens)} tokens, max_tokens {req.params.max_tokens}) "
                           f"does not fit pool {cfg.pool_id!r} even alone: {cfg.num_blocks - 1} blocks of "
                           f"{self._tokens_per_block} tokens; raise num_blocks")

    def _sample(self, reqs: list[EngineRequest], logits: torch.Tensor) -> None:
        for req, row in zip(reqs, logits):
            position = len(req.tokens)
            if self.record_logits:
                req.logits_seen.append((position, row.clone()))
            if req.children_pending:
                # Parallel sampling: the prompt is computed; children fork from it and sample their own
                # first token from the same logits.
                for k in range(req.children_pending):
                    child = EngineRequest(f"{req.request_id}/s{k + 1}", list(req.tokens), req.num_prompt_tokens,
                                          req.params, req.seed + k + 1, RequestState.FORKING,
                                          num_computed=req.num_computed, num_sent=req.num_sent, parent=req,
                                          hit_tokens=req.hit_tokens)
                    if self.record_logits:
                        child.logits_seen.append((position, row.clone()))
                    self._emit(child, sample(row, req.params.temperature, child.seed, position))
                    self._forks.append((req, child))
                req.children_pending = 0
            self._emit(req, sample(row, req.params.temperature, req.seed, position))

    @property
    def _tokens_per_block(self) -> int:
        return self.config.tokens_per_block(0)

    def _emit(self, req: EngineRequest, token: int) -> None:
        if not req.first_token_at:
            req.first_token_at = time.perf_counter()
        req.tokens.append(token)
        req.num_generated += 1
        self.stats.generated_tokens += 1
        params = req.params
        if params.stop_token_ids and token in params.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.config.eos_token_ids:
            req.finish_reason = "stop"
        elif req.num_generated >= params.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            if req.running:
                self.running.remove(req)
            req.state = RequestState.FINISHED
            self._frees.append(req)
            self.finished.append(req)
