"""ModelRunner against the model's dense reference: chunked prefill, decode, mixed batches, DCP, copy-on-write.

`FakeEngine` plays allocator and scheduler by hand: shuffled block ids, table rows out of batch order,
blocks freed and reused with stale contents. Every logit the runner returns is compared with
`dense_logits` of the request's final sequence at the same position, and greedy tokens must agree.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

from worker.batch import RowUpdate, StepBatch
from worker.model import ModelConfig, TinyTransformer
from worker.runner import ModelRunner

BLOCK_SIZE = 4  # per rank
NUM_BLOCKS = 48
VOCAB = ModelConfig().vocab_size
TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Intra-op threads spin against the DCP rank threads (and other processes) on a small shared machine:
    a 64x256x384 matmul takes 15 ms with 2 threads there and 0.6 ms with 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference() -> TinyTransformer:
    return TinyTransformer(ModelConfig(), device="cpu")


class InProcessGroup:
    """all_gather for W runner threads: each rank posts its tensor, then every rank stacks all of them."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def all_gather_for(self, rank: int):
        def all_gather(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            self.barrier.wait()  # no rank posts its next tensor before every rank has stacked this one
            return stacked

        return all_gather


class Ranks:
    """The W ranks of one pool, each a ModelRunner; `execute` runs a step on all of them in lockstep."""

    def __init__(self, world_size: int = 1, interleave: int = 1, backend: str = "torch") -> None:
        self.group = InProcessGroup(world_size)
        self.runners = [
            ModelRunner(
                ModelConfig(),
                num_blocks=NUM_BLOCKS,
                block_size=BLOCK_SIZE,
                max_num_reqs=6,
                max_num_blocks_per_req=16,
                max_num_batched_tokens=64,
                dcp_world_size=world_size,
                dcp_rank=rank,
                interleave=interleave,
                backend=backend,
                all_gather=self.group.all_gather_for(rank) if world_size > 1 else None,
                device="cpu",
            )
            for rank in range(world_size)
        ]
        self.tokens_per_block = BLOCK_SIZE * world_size

    def execute(self, batch: StepBatch) -> torch.Tensor:
        if len(self.runners) == 1:
            return self.runners[0].execute(batch)
        results: list[torch.Tensor | None] = [None] * len(self.runners)
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                results[rank] = self.runners[rank].execute(batch)
            except BaseException as e:  # re-raised in the test thread
                errors.append(e)
                self.group.barrier.abort()  # release the other ranks instead of letting them wait

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(self.runners))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for rank, logits in enumerate(results[1:], start=1):
            torch.testing.assert_close(logits, results[0], atol=1e-6, rtol=0, msg=lambda m, r=rank: f"rank {r}: {m}")
        return results[0]


@dataclass(slots=True)
class Req:
    tokens: list[int]  # prompt, then the greedy tokens generated so far
    row: int
    max_new_tokens: int = 3
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> runner logits
    prompt_len: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.tokens)

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed


class FakeEngine:
    """Allocator and scheduler by hand: block ids come from a shuffled pool; every token's logits are kept."""

    def __init__(self, ranks: Ranks, seed: int = 0) -> None:
        self.ranks = ranks
        self.tokens_per_block = ranks.tokens_per_block
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
        self.updates: list[RowUpdate] = []
        self.copies: list[tuple[int, int]] = []
        self.clears: list[int] = []
        self.batches: list[StepBatch] = []

    def finish(self, req: Req) -> None:
        self.clears.append(req.row)
        self.free.extend(req.blocks)  # popped first by the next allocation: reused with stale K/V

    def fork(self, parent: Req, row: int, next_token: int) -> Req:
        """A child sharing the parent's blocks (as parallel sampling or a prefix hit would); the partial
        last block, which both are about to write, is copied on write for the child."""
        assert parent.num_pending == 1 and parent.num_computed % self.tokens_per_block
        child = Req(
            parent.tokens[:-1] + [next_token],
            row,
            parent.max_new_tokens,
            parent.num_computed,
            list(parent.blocks),
            prompt_len=parent.prompt_len,
        )
        idx, new = len(child.blocks) - 1, self.free.pop()
        self.updates.append(RowUpdate(row=row, set_blocks=[list(parent.blocks)], replace=[(0, idx, new)]))
        self.copies.append((parent.blocks[idx], new))
        child.blocks[idx] = new
        return child

    def flush(self) -> None:
        """Send the pending row clears in a step without tokens."""
        batch = StepBatch(self.clears, [], [], [], [], [], [0], [], [])
        self.clears = []
        assert self.ranks.execute(batch).shape == (0, VOCAB)

    def step(self, work: list[tuple[Req, int]]) -> StepBatch:
        """Schedule `n` new tokens of each request (in this order), run every rank, record the logits."""
        updates = {u.row: u for u in self.updates}
        input_ids, positions, rows, qsl, seq_lens = [], [], [], [0], []
        for req, n in work:
            start, end = req.num_computed, req.num_computed + n
            assert 0 < n <= req.num_pending
            new_blocks = [self.free.pop() for _ in range(-(-end // self.tokens_per_block) - len(req.blocks))]
            if req.row in updates:
                updates[req.row].append_blocks = [(updates[req.row].append_blocks or [[]])[0] + new_blocks]
            elif not req.blocks:
                updates[req.row] = RowUpdate(row=req.row, set_blocks=[new_blocks])
            elif new_blocks:
                updates[req.row] = RowUpdate(row=req.row, append_blocks=[new_blocks])
            req.blocks += new_blocks
            input_ids += req.tokens[start:end]
            positions += range(start, end)
            rows.append(req.row)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
        batch = StepBatch(
            clear_rows=self.clears,
            row_updates=list(updates.values()),
            copies=self.copies,
            input_ids=input_ids,
            positions=positions,
            rows=rows,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            logits_indices=list(range(len(input_ids))),
        )
        self.updates, self.copies, self.clears = [], [], []
        self.batches.append(batch)
        logits = self.ranks.execute(batch)
        assert logits.shape == (len(input_ids), VOCAB) and logits.dtype == torch.float32
        for (req, n), start in zip(work, qsl, strict=False):
            for i in range(n):
                req.logits[req.num_computed + i] = logits[start + i]
            req.num_computed += n
            if req.num_pending == 0:
                req.tokens.append(int(logits[start + n - 1].argmax()))  # greedy
        return batch


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_against_dense(reference: TinyTransformer, reqs: list[Req]) -> None:
    for n, req in enumerate(reqs):
        assert req.logits, f"request {n} got no logits"
        dense = reference.dense_logits(req.tokens)
        for pos, logits in sorted(req.logits.items()):
            torch.testing.assert_close(
                logits, dense[pos], **TOL, msg=lambda m, n=n, p=pos: f"request {n} position {p}: {m}"
            )
            # Greedy decoding appended the runner's argmax; the reference must pick the same token.
            assert int(dense[pos].argmax()) == int(logits.argmax()), f"request {n} position {pos}: greedy differs"


def is_mixed(batch: StepBatch) -> bool:
    q_lens = [e - s for s, e in zip(batch.query_start_loc, batch.query_start_loc[1:], strict=False)]
    return 1 in q_lens and any(n > 1 for n in q_lens)


def run_staggered(ranks: Ranks, chunk: int = 8) -> list[Req]:
    """Three requests arriving at different steps, chunked prefill, decode; the first to finish frees its row
    and blocks, which a fourth request then takes."""
    engine = FakeEngine(ranks)
    a = Req(prompt(19, 1), row=3, max_new_tokens=3)
    b = Req(prompt(9, 2), row=0, max_new_tokens=6)
    c = Req(prompt(13, 3), row=5, max_new_tokens=5)
    d = Req(prompt(11, 4), row=3, max_new_tokens=4)
    arrivals = {0: [a], 1: [b], 3: [c]}
    active: list[Req] = []
    done: list[Req] = []
    for step in range(40):
        active += arrivals.pop(step, [])
        if not active and not arrivals:
            break
        engine.step([(r, min(chunk, r.num_pending)) for r in active])
        for req in [r for r in active if r.done]:
            active.remove(req)
            done.append(req)
            engine.finish(req)
            if req is a:
                arrivals[step + 1] = [d]
    engine.flush()
    for runner in ranks.runners:
        assert not runner.block_table.num_blocks_per_row.any(), "finished requests' rows should be cleared"
    assert len(done) == 4 and d.blocks and set(d.blocks) & set(a.blocks), "d should reuse a's freed blocks"
    assert any(is_mixed(bt) for bt in engine.batches), "expected a batch with a prefill chunk next to a decode"
    assert any(u.append_blocks for bt in engine.batches for u in bt.row_updates if bt.num_tokens < 4)
    return [a, b, c, d]


@pytest.mark.parametrize(("world_size", "interleave"), [(1, 1), (2, 1), (2, 2)])
def test_chunked_prefill_and_decode_match_dense(reference, world_size, interleave):
    reqs = run_staggered(Ranks(world_size, interleave))
    check_against_dense(reference, reqs)
    if world_size > 1:
        single = run_staggered(Ranks(1))
        for req, one in zip(reqs, single, strict=True):
            assert req.tokens == one.tokens
            for pos, logits in req.logits.items():
                torch.testing.assert_close(logits, one.logits[pos], **TOL, msg=lambda m, p=pos: f"vs W=1 at {p}: {m}")


def test_mixed_batch_prefill_chunk_and_decode(reference):
    engine = FakeEngine(Ranks())
    a, b = Req(prompt(10, 5), row=1), Req(prompt(12, 6), row=0)
    engine.step([(a, 10)])
    mixed = engine.step([(b, 7), (a, 1)])
    assert mixed.rows == [0, 1] and mixed.query_start_loc == [0, 7, 8] and mixed.seq_lens == [7, 11]
    engine.step([(a, 1), (b, 5)])
    check_against_dense(reference, [a, b])


def test_triton_backend_matches_dense_and_torch(reference):
    """The real kernels (the Triton interpreter on CPU): one prefill of two requests, then one decode."""
    reqs = {}
    for backend in ("triton", "torch"):
        ranks = Ranks(backend=backend)
        assert ranks.runners[0].backend == backend
        engine = FakeEngine(ranks)
        a, b = Req(prompt(6, 7), row=2), Req(prompt(9, 8), row=0)
        engine.step([(a, 6), (b, 9)])
        engine.step([(b, 1), (a, 1)])
        reqs[backend] = [a, b]
    check_against_dense(reference, reqs["triton"])
    for tr, to in zip(reqs["triton"], reqs["torch"], strict=True):
        assert tr.tokens == to.tokens
        for pos, logits in tr.logits.items():
            torch.testing.assert_close(logits, to.logits[pos], **TOL)


@pytest.mark.parametrize("world_size", [1, 2])
def test_copy_on_write_fork_decodes_both(reference, world_size):
    ranks = Ranks(world_size)
    engine = FakeEngine(ranks)
    parent = Req(prompt(2 * ranks.tokens_per_block + 3, 9), row=4, max_new_tokens=4)
    engine.step([(parent, parent.num_pending)])
    # The child samples a different first token: both now write position len(prompt) into their last block.
    child = engine.fork(parent, row=1, next_token=(parent.tokens[-1] + 1) % VOCAB)
    batch = engine.step([(parent, 1), (child, 1)])
    assert batch.copies and batch.row_updates[0].replace
    while not (parent.done and child.done):
        engine.step([(r, 1) for r in (child, parent) if not r.done])
    assert parent.tokens[parent.prompt_len] != child.tokens[child.prompt_len]
    check_against_dense(reference, [parent, child])


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        ModelRunner(ModelConfig(), 8, BLOCK_SIZE, 2, 4, 16, backend="cuda")


def test_dcp_without_all_gather_raises():
    with pytest.raises(ValueError, match="all_gather"):
        ModelRunner(ModelConfig(), 8, BLOCK_SIZE, 2, 4, 16, dcp_world_size=2, dcp_rank=1)


def test_sequence_longer_than_its_blocks_raises():
    runner = Ranks().runners[0]
    batch = StepBatch([], [RowUpdate(row=0, set_blocks=[[5]])], [], list(range(5)), list(range(5)), [0], [0, 5], [5],
                      [4])
    with pytest.raises(ValueError, match="row 0 holds blocks for 4 tokens of group 0 but its sequence is 5 long"):
        runner.execute(batch)
