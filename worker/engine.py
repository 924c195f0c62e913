"""The driver: a continuous-batching scheduler whose KV memory is managed by the allocator service.

One scheduler step = one allocator `Step` RPC (frees, forks, a packed decode batch, prefill chunks
and admissions under a token budget) -> block-table updates and copy-on-write copies -> one forward
pass on every DCP rank of the pool -> sampling. `NO_SPACE` preempts a request (freed, recomputed
later); prefix-cache hits skip their prefill; parallel sampling forks the prompt (copy-on-write).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvservice.client import KVServiceClient
from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.ops import AddRequestOp, AllocateOp, DecodeBatchOp, ForkOp, FreeOp, OpStatus
from worker.batch import RowUpdate, StepBatch
from worker.sampling import SamplingParams, sample


class Workers(Protocol):
    """The ranks of one pool: every rank executes the same batch; logits come back once."""

    def execute(self, batch: StepBatch) -> torch.Tensor: ...


@dataclass(slots=True)
class EngineConfig:
    pool_id: str = "engine-0"
    num_blocks: int = 512  # includes the null block
    block_size: int = 16  # per rank; an allocator block spans block_size * dcp_world_size tokens
    dcp_world_size: int = 1
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    epoch: int = 0
    enable_prefix_caching: bool = True
    allow_transfers: bool = False  # adopt prefixes cached on other pools (needs their workers: `peers`)
    kv_layout: str = ""  # pools exchange blocks only with equal layouts (PoolLayout.kv_layout)

    @property
    def max_num_rows(self) -> int:
        """Block-table rows the workers need (running requests plus those being freed or forked)."""
        return 2 * self.max_num_seqs + 8

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.max_model_len // (self.block_size * self.dcp_world_size))


@dataclass(slots=True)
class Sequence:
    seq_id: str
    tokens: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    num_computed: int = 0
    num_sent: int = 0  # tokens the allocator knows (the last sampled one is sent with the next decode)
    row: int | None = None
    table: list[int] = field(default_factory=list)  # the engine's mirror of the worker row (group 0)
    added: bool = False  # the allocator knows the request
    running: bool = False  # it holds blocks
    finished: bool = False
    num_generated: int = 0
    num_preemptions: int = 0
    hit_tokens: int = -1  # prefix-cache hit at first admission
    transferred_tokens: int = 0  # of which copied from another pool
    no_transfer: bool = False  # a transfer for it failed: recompute instead
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    parent: Sequence | None = None
    children_pending: int = 0  # forks to issue once the prompt is computed
    logits_seen: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, logits) if recorded

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    copies: int = 0
    forks: int = 0
    transfers: int = 0
    transferred_tokens: int = 0
    transfer_s: float = 0.0
    peak_blocks: int = 0
    peak_running: int = 0
    allocator_s: float = 0.0
    model_s: float = 0.0
    total_s: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Engine:
    def __init__(self, client: KVServiceClient, workers: Workers, config: EngineConfig,
                 record_logits: bool = False, peers: dict[str, Workers] | None = None) -> None:
        self.client = client
        self.workers = workers
        self.config = config
        self.peers = peers if peers is not None else {}  # other pools' workers, for transfers
        self.record_logits = record_logits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self._frees: list[Sequence] = []
        self._forks: list[tuple[Sequence, Sequence]] = []
        self._free_rows = list(range(config.max_num_rows - 1, -1, -1))
        self._clear_rows: list[int] = []
        self._ids = itertools.count()
        self.stats = EngineStats()
        self._transfers: list = []
        self.registration = self._register()

    def _register(self):
        """Registers the pool at the configured epoch (its config, hash spec and KV layout)."""
        cfg = self.config
        return self.client.register_pool(
            cfg.pool_id, KVCacheConfig(cfg.num_blocks, [FullAttentionSpec(cfg.block_size)]), cfg.max_model_len,
            epoch=cfg.epoch, dcp_world_size=cfg.dcp_world_size, enable_caching=cfg.enable_prefix_caching,
            kv_layout=cfg.kv_layout or f"block={cfg.block_size};dcp={cfg.dcp_world_size}")

    def restart_pool(self, workers: Workers) -> None:
        """The workers died (their KV memory is gone): register a new epoch with fresh workers. The
        allocator fails the pool's requests; they are recomputed from their tokens."""
        self.workers = workers
        self.config.epoch += 1
        cfg = self.config
        self.registration = self._register()
        orphans = [child for _, child in self._forks if not child.finished]
        for seq in [*self.running, *orphans]:
            seq.running, seq.added, seq.num_computed, seq.num_sent, seq.table, seq.row = False, False, 0, 0, [], None
            seq.parent = None if seq in orphans else seq.parent
            seq.num_preemptions += 1
            self.waiting.appendleft(seq)
        self.running, self._frees, self._forks, self._transfers, self._clear_rows = [], [], [], [], []
        self._free_rows = list(range(cfg.max_num_rows - 1, -1, -1))

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        params = params or SamplingParams()
        if not prompt or len(prompt) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} must fit "
                             f"max_model_len {self.config.max_model_len}")
        seq = Sequence(request_id or f"req-{next(self._ids)}", list(prompt), len(prompt), params, params.seed,
                       children_pending=params.n - 1)
        self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._frees or self._forks)

    def run(self, max_steps: int = 1_000_000, progress=None) -> list[Sequence]:
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
        ops, plan = self._schedule()
        t0 = time.perf_counter()
        result = self.client.step(self.config.pool_id, ops)
        self.stats.allocator_s += time.perf_counter() - t0
        batch, scheduled = self._apply(result, plan)
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

    def _schedule(self):
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        # Forks first (a parent may finish in the same step), then frees, then work.
        ops: list = [ForkOp(parent.seq_id, child.seq_id) for parent, child in self._forks]
        ops += [FreeOp(s.seq_id) for s in self._frees]
        plan: dict = {"frees": self._frees, "forks": self._forks, "decode": [], "chunks": [], "admits": []}
        self._frees, self._forks = [], []
        decode_ids, decode_computed, decode_tokens = [], [], []
        for seq in self.running:
            remaining = len(seq.tokens) - seq.num_computed
            if budget <= 0 or remaining <= 0:
                continue
            if seq.num_sent == len(seq.tokens) - 1:  # decode: send the sampled token, compute it
                decode_ids.append(seq.seq_id)
                decode_computed.append(seq.num_computed)
                decode_tokens.append(seq.tokens[-1])
                plan["decode"].append(seq)
                budget -= 1
            else:
                n = min(remaining, budget)
                ops.append(AllocateOp(seq.seq_id, num_computed_tokens=seq.num_computed, num_new_tokens=n))
                plan["chunks"].append(seq)
                budget -= n
        if decode_ids:
            ops.append(DecodeBatchOp(decode_ids, decode_computed, decode_tokens))
        num_running = len(self.running) + len(plan["forks"])
        while self.waiting and budget > 0 and num_running < cfg.max_num_seqs:
            seq = self.waiting.popleft()
            if not seq.added:
                ops.append(AddRequestOp(seq.seq_id, token_ids=seq.tokens))
                seq.added = True
                seq.num_sent = len(seq.tokens)
            ops.append(AllocateOp(seq.seq_id, num_computed_tokens=0, num_new_tokens=budget,
                                  allow_transfer=cfg.allow_transfers and not seq.no_transfer))
            plan["admits"].append(seq)
            budget -= min(budget, len(seq.tokens))
            num_running += 1
        return ops, plan

    def _apply(self, result, plan) -> tuple[StepBatch | None, list]:
        """Reads the allocator's reply: which tokens run, block-table changes, copies, preemptions."""
        by_id = {}
        batch_results = None
        for r in result.results:
            if r.batch is not None:
                batch_results = r.batch
            else:
                by_id.setdefault(r.request_id, []).append(r)
        for seq in plan["frees"]:
            if seq.row is not None:
                self._clear_rows.append(seq.row)
                self._free_rows.append(seq.row)
                seq.row = None
        updates: list[RowUpdate] = []
        scheduled: list[tuple[Sequence, int, int]] = []  # (seq, start, count)
        for parent, child in plan["forks"]:
            r = by_id[child.seq_id][-1]
            if r.status != OpStatus.OK:
                raise RuntimeError(f"fork of {parent.seq_id} failed: {r.status.name} {r.message}")
            child.table = list(r.new_block_ids[0])
            child.added = True
            self.stats.forks += 1
            if child.finished:  # it sampled its last token already; freed in this same step
                continue
            child.row = self._free_rows.pop()
            child.running = True
            updates.append(RowUpdate(child.row, set_blocks=list(child.table)))
            self.running.append(child)
        if batch_results is not None:
            per_request = batch_results.block_ids()
            replaced: dict[int, list] = {}
            for i, _group, index, block_id in batch_results.replaced:
                replaced.setdefault(i, []).append((index, block_id))
            for i, seq in enumerate(plan["decode"]):
                status = batch_results.status(i)
                if status == OpStatus.OK:
                    seq.num_sent += 1
                    self._grow(seq, per_request[i][0], replaced.get(i, []), updates)
                    scheduled.append((seq, batch_results.num_computed_tokens[i],
                                      batch_results.num_scheduled_tokens[i]))
                else:
                    self._preempt(seq, status)
        for seq in plan["chunks"]:
            r = by_id[seq.seq_id][-1]
            if r.status == OpStatus.OK:
                self._grow(seq, r.new_block_ids[0] if r.new_block_ids else [], [(i, b) for _, i, b in r.replaced],
                           updates)
                scheduled.append((seq, r.num_computed_tokens, r.num_scheduled_tokens))
            else:
                self._preempt(seq, r.status)
        for seq in plan["admits"]:
            r = by_id[seq.seq_id][-1]
            if r.status == OpStatus.NO_SPACE:
                self.waiting.appendleft(seq)  # retried next step (FCFS)
                continue
            if r.status != OpStatus.OK:
                raise RuntimeError(f"admission of {seq.seq_id} failed: {r.status.name} {r.message}")
            if r.transfer is not None and r.transfer.src_pool_id not in self.peers:
                # We cannot reach the source pool's workers: give the order back and recompute.
                self.client.commit_transfer(self.config.pool_id, r.transfer.transfer_id, abort=True)
                seq.added, seq.no_transfer = False, True
                self.waiting.appendleft(seq)
                continue
            seq.running = True
            seq.num_computed = r.num_computed_tokens
            if r.transfer is not None:
                self._transfers.append(r.transfer)
                seq.transferred_tokens = len(r.transfer.dst_block_ids) * self._tokens_per_block
                self.stats.transfers += 1
                self.stats.transferred_tokens += seq.transferred_tokens
            if seq.hit_tokens < 0:
                seq.hit_tokens = r.num_computed_tokens
                seq.admitted_at = time.perf_counter()
                self.stats.prompt_tokens += seq.num_prompt_tokens
                self.stats.hit_tokens += r.num_computed_tokens
            seq.table = list(r.new_block_ids[0]) if r.new_block_ids else []
            seq.row = self._free_rows.pop()
            updates.append(RowUpdate(seq.row, set_blocks=list(seq.table)))
            self.running.append(seq)
            scheduled.append((seq, r.num_computed_tokens, r.num_scheduled_tokens))
        self.stats.copies += len(result.copies)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        self.stats.peak_blocks = max(self.stats.peak_blocks,
                                     len({b for s in self.running for b in s.table if b}))
        if not scheduled and not updates and not self._clear_rows:
            return None, []
        input_ids, positions, rows, qsl, seq_lens, logits_indices = [], [], [], [0], [], []
        needs_logits = []
        for seq, start, count in scheduled:
            input_ids += seq.tokens[start:start + count]
            positions += range(start, start + count)
            rows.append(seq.row)
            qsl.append(qsl[-1] + count)
            seq_lens.append(start + count)
            seq.num_computed = start + count
            if start + count == len(seq.tokens):
                logits_indices.append(qsl[-1] - 1)
                needs_logits.append(seq)
            self.stats.computed_tokens += count
        batch = StepBatch(self._clear_rows, updates, list(result.copies), input_ids, positions, rows, qsl, seq_lens,
                          logits_indices)
        self._clear_rows = []
        return batch, needs_logits

    def _grow(self, seq: Sequence, new_blocks: list[int], replaced: list[tuple[int, int]],
              updates: list[RowUpdate]) -> None:
        for index, block_id in replaced:
            seq.table[index] = block_id
        seq.table += new_blocks
        if new_blocks or replaced:
            updates.append(RowUpdate(seq.row, append_blocks=list(new_blocks), replace=list(replaced)))

    def _preempt(self, seq: Sequence, status: OpStatus) -> None:
        """No room (or the pool's memory is gone): free it and recompute it later from its tokens."""
        if status not in (OpStatus.NO_SPACE, OpStatus.EPOCH_CHANGED):
            raise RuntimeError(f"{seq.seq_id}: unexpected {status.name}")
        self.running.remove(seq)
        if status == OpStatus.NO_SPACE:
            self._frees.append(seq)  # the allocator still holds it
        elif seq.row is not None:
            self._clear_rows.append(seq.row)
            self._free_rows.append(seq.row)
            seq.row = None
        seq.running, seq.added, seq.num_computed, seq.num_sent, seq.table = False, False, 0, 0, []
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        for seq, row in zip(seqs, logits):
            position = len(seq.tokens)
            if self.record_logits:
                seq.logits_seen.append((position, row.clone()))
            if seq.children_pending:
                # Parallel sampling: the prompt is computed; children fork from it and sample their own
                # first token from the same logits.
                for k in range(seq.children_pending):
                    child = Sequence(f"{seq.seq_id}/s{k + 1}", list(seq.tokens), seq.num_prompt_tokens, seq.params,
                                     seq.seed + k + 1, num_computed=seq.num_computed, num_sent=seq.num_sent,
                                     parent=seq, hit_tokens=seq.hit_tokens)
                    if self.record_logits:
                        child.logits_seen.append((position, row.clone()))
                    self._emit(child, sample(row, seq.params.temperature, child.seed, position))
                    self._forks.append((seq, child))
                seq.children_pending = 0
            self._emit(seq, sample(row, seq.params.temperature, seq.seed, position))

    @property
    def _tokens_per_block(self) -> int:
        return self.config.block_size * self.config.dcp_world_size

    def _emit(self, seq: Sequence, token: int) -> None:
        if not seq.first_token_at:
            seq.first_token_at = time.perf_counter()
        seq.tokens.append(token)
        seq.num_generated += 1
        self.stats.generated_tokens += 1
        if seq.num_generated >= seq.params.max_tokens:
            seq.finished = True
            if seq in self.running:
                self.running.remove(seq)
            self._frees.append(seq)
            self.finished.append(seq)
