"""Random scheduler traces over the wire against the core called directly as vLLM's scheduler calls its
KVCacheManager (pools with vLLM 0.33.0's semantics, RegisterPool `vllm`): the same results and the same
state after every step; the WAL replayed and a snapshot restored reach the same state."""

import random

import pytest

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.allocator.pools import VllmKVCacheManager
from kvservice.commands import PoolSpec, StepRpc, VllmOptions
from kvservice.core import FullAttentionSpec, KVCacheConfig, Request, SlidingWindowSpec
from kvservice.hashing import HashSpec
from kvservice.ops import AddRequestOp, AllocateBatchOp, AllocateOp, FreeOp, OpStatus
from kvservice.store import wal
from kvservice.store.snapshot import dump, load, state_digest
from kvservice.wire import decode, encode
from tests.core_helpers import pool_state
from tests.service_helpers import SMALL_HASH_BLOCK

BS = SMALL_HASH_BLOCK
SPEC = HashSpec("sha256", None, BS)

CASES = {
    "full": [FullAttentionSpec(BS)],
    "full+sliding window": [FullAttentionSpec(BS), SlidingWindowSpec(BS, sliding_window=8)],
}


class Reference:
    """The core driven directly, as vLLM's scheduler drives its KVCacheManager."""

    def __init__(self, groups, num_blocks: int, watermark: float) -> None:
        self.manager = VllmKVCacheManager(KVCacheConfig(num_blocks, list(groups)), 128, hash_block_size=BS,
                                          enable_fast_path=False, watermark=watermark)
        self.requests: dict[str, Request] = {}


class WireSession:
    """One session whose commands come off the wire (encoded, decoded as the servicer does) and are journaled:
    a replica allocator applies each from its WAL record."""

    def __init__(self, allocator: Allocator) -> None:
        self.allocator, self.replica = allocator, Allocator(hash_block_size=BS)
        self.sequence = 0
        self._apply(decode.open_session_command(pb.OpenSessionRequest(client_name="t"), "s", "", True))

    def _apply(self, command):
        self.replica.apply(wal.decode(wal.encode(command), BS), 0.0)
        return self.allocator.apply(command, 0.0).reply

    def register(self, spec: PoolSpec) -> None:
        self.sequence += 1
        msg = encode.register_request(spec.pool_id, spec.config, spec.max_model_len, 0, 1, True, 0, "",
                                      spec.hash_spec.fingerprint(), spec.hash_spec, spec.vllm)
        msg.session_id, msg.sequence = "s", self.sequence
        self._apply(decode.register_command(msg, msg.SerializeToString(), "", True, BS))

    def step(self, pool_id: str, ops):
        self.sequence += 1
        msg = encode.step_request(pool_id, ops)
        msg.session_id, msg.sequence = "s", self.sequence
        return self._apply(decode.step_command(StepRpc.STEP, msg, msg.SerializeToString(), "", True))


class Sched:
    """A small scheduler loop (admissions with hits, chunked prefill, async placeholders, preemption, finishes)
    that issues every call twice: to the reference core, and as the op the allocator gets."""

    def __init__(self, rng, groups, num_blocks, watermark) -> None:
        self.rng = rng
        self.ref = Reference(groups, num_blocks, watermark)
        self.allocator = Allocator(hash_block_size=BS)
        self.session = WireSession(self.allocator)
        # The twin gets each step's ops with every run of lookup-free AllocateOps packed as an AllocateBatchOp.
        self.packed = Allocator(hash_block_size=BS)
        self.twin = WireSession(self.packed)
        for session in (self.session, self.twin):
            session.register(PoolSpec("p", KVCacheConfig(num_blocks, list(groups)), 128, hash_spec=SPEC,
                                      vllm=VllmOptions(watermark)))
        self.tokens: dict[str, list[int]] = {}
        self.sent: dict[str, int] = {}  # tokens the server knows
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.placeholders: dict[str, int] = {}
        self.ids = 0
        prefixes = [[rng.randrange(50) for _ in range(n)] for n in (8, 13, 20)]
        self.prefixes = prefixes

    def step(self) -> None:
        rng = self.rng
        ops, expect = [], []
        m = self.ref.manager
        for rid in list(self.running):  # async: last step's sample arrives, its block cached
            if self.placeholders[rid] and rng.random() < 0.8:
                req = self.ref.requests[rid]
                token = rng.randrange(50)
                self.tokens[rid].append(token)
                req.append_output_token_ids(token)
                self.placeholders[rid] -= 1
                req.num_in_flight_tokens = self.placeholders[rid]
                cache = req.num_computed_tokens - req.num_in_flight_tokens
                m.cache_blocks(req, cache)
                ops.append(self._op(rid, cache_tokens=cache))
                expect.append(None)
            if rng.random() < 0.05:  # finished
                self._free(rid, ops, expect)
        for rid in list(self.running):
            req = self.ref.requests[rid]
            # vLLM's bound: no further than the known tokens plus the placeholders of tokens being sampled.
            n = min(rng.randrange(1, 6), 128 - req.num_computed_tokens - 2,
                    req.num_tokens + self.placeholders[rid] - req.num_computed_tokens)
            if n <= 0:
                continue
            new = m.allocate_slots(req, n)
            ops.append(self._op(rid, num_new_tokens=n))
            expect.append(new)
            if new is None:  # preempt it
                self._free(rid, ops, expect)
                self.waiting.insert(0, rid)
                continue
            req.num_computed_tokens += n
            self.placeholders[rid] = _placeholders(req)
            req.num_in_flight_tokens = n
        if rng.random() < 0.5 and len(self.waiting) < 4:
            self.ids += 1
            rid = f"r{self.ids}"
            self.tokens[rid] = rng.choice(self.prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            self.waiting.append(rid)
        while self.waiting and rng.random() < 0.7:
            rid = self.waiting[0]
            tokens = self.tokens[rid]
            req = Request(rid, tokens, BS, hash_spec=SPEC)
            blocks, hit, _ = m.find_computed_blocks(req, record_stats=False)
            n = min(len(tokens) - hit, rng.randrange(1, 24))
            gate = rng.random() < 0.7
            scheduled = bool(self.running)
            req.waiting = True
            new = m.allocate_slots(req, n, hit, blocks, full_sequence_must_fit=gate, has_scheduled_reqs=scheduled)
            if rid not in self.sent:
                ops.append(AddRequestOp(rid, block_hashes=list(req.block_hashes), num_tokens=len(tokens)))
                expect.append(None)
                self.sent[rid] = len(tokens)
            ops.append(AllocateOp(rid, num_new_tokens=n, lookup=True, num_new_computed_tokens=hit, waiting=True,
                                  full_sequence_must_fit=gate, has_scheduled_reqs=scheduled))
            expect.append(("admit", new, req))
            if new is None:
                break
            self.waiting.pop(0)
            req.waiting = False
            req.num_computed_tokens = hit + n
            req.num_in_flight_tokens = n
            self.ref.requests[rid] = req
            self.running.append(rid)
            self.placeholders[rid] = _placeholders(req)
        if not ops:
            return
        result = self.session.step("p", ops)
        twin = self.twin.step("p", pack_runs(ops))
        num_groups = m.num_kv_cache_groups
        assert unpacked(twin, num_groups) == [(r.status, _groups(r.new_block_ids, num_groups)) for r in result.results]
        assert twin.num_free_blocks == result.num_free_blocks
        single, packed = self.allocator.state.pools["p"], self.packed.state.pools["p"]
        assert pool_state(packed.manager) == pool_state(single.manager)
        assert _counters(packed) == _counters(single)
        for op, want, got in zip(ops, expect, result.results):
            if isinstance(want, tuple):
                _, new, req = want
                assert got.status == (OpStatus.OK if new is not None else OpStatus.NO_SPACE), (op, got)
                if new is not None:
                    assert got.new_block_ids == m.get_block_ids(req.request_id)
            elif isinstance(op, AllocateOp) and op.num_new_tokens:
                assert got.status == (OpStatus.OK if want is not None else OpStatus.NO_SPACE), (op, got)
                if want is not None:
                    assert got.new_block_ids == want.get_block_ids()
            else:
                assert got.status == OpStatus.OK, (op, got)
        assert result.num_free_blocks == m.block_pool.get_num_free_blocks()
        assert pool_state(self.allocator.state.pools["p"].manager) == pool_state(m)

    def _op(self, rid: str, **kw) -> AllocateOp:
        req = self.ref.requests[rid]
        new_hashes = req.block_hashes[self.sent[rid] // BS:]
        num_append = req.num_tokens - self.sent[rid]
        self.sent[rid] = req.num_tokens
        return AllocateOp(rid, num_computed_tokens=req.num_computed_tokens, append_block_hashes=list(new_hashes),
                          num_append_tokens=num_append, num_output_placeholders=self.placeholders.get(rid, 0),
                          num_in_flight_tokens=req.num_in_flight_tokens, **kw)

    def _free(self, rid: str, ops, expect) -> None:
        self.ref.manager.free(self.ref.requests.pop(rid))
        self.running.remove(rid)
        self.sent.pop(rid)
        ops.append(FreeOp(rid))
        expect.append(None)


def pack_runs(ops: list) -> list:
    """Each run of AllocateOps without a lookup as one AllocateBatchOp."""
    out, run = [], []
    for op in ops + [None]:
        if isinstance(op, AllocateOp) and not op.lookup:
            run.append(op)
            continue
        if run:
            out.append(AllocateBatchOp.of(run))
            run = []
        if op is not None:
            out.append(op)
    return out


def _counters(pool) -> dict:
    """What an AllocateOp sets on the pool's requests."""
    return {k: (r.num_tokens, r.num_computed_tokens, r.num_in_flight_tokens, r.waiting, tuple(r.block_hashes))
            for k, r in pool.requests.items()}


def unpacked(result, num_groups: int) -> list:
    """(status, new block ids per group) of every op, a batch's rows one by one."""
    out = []
    for r in result.results:
        if r.batch is None:
            out.append((r.status, _groups(r.new_block_ids, num_groups)))
            continue
        tables = r.batch.block_ids()
        out.extend((r.batch.status(i), tables[i]) for i in range(len(r.batch)))
    return out


def _groups(ids, num_groups: int) -> tuple:
    return tuple(list(g) for g in ids) if ids else tuple([] for _ in range(num_groups))


def _placeholders(req: Request) -> int:
    """vLLM's async scheduler after a step: one token being sampled once the prompt is computed."""
    return max(0, req.num_computed_tokens + 1 - req.num_tokens)


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_traces_equal_the_core_called_as_vllm_does(case):
    for seed in range(6):
        rng = random.Random(seed)
        sched = Sched(rng, CASES[case], rng.choice([12, 20, 40]), rng.choice([0.0, 0.1]))
        for _ in range(120):
            sched.step()
        assert state_digest(sched.session.replica) == state_digest(sched.allocator)
        assert state_digest(sched.twin.replica) == state_digest(sched.packed)  # its WAL replays it too
        restored = Allocator(hash_block_size=BS)
        load(dump(sched.allocator), restored, 0.0)
        assert state_digest(restored) == state_digest(sched.allocator)
