"""Pools with vLLM 0.33.0's semantics over the wire (RegisterPool `vllm`): an AllocateOp is vLLM's
allocate_slots — output placeholders (async scheduling) with their hashes appended and cached later, the
full-sequence gate, the watermark, reserved blocks — and a refusal changes nothing. Scenarios with exact
block ids against a real server; random scheduler traces against the core called directly as vLLM's
scheduler calls its KVCacheManager (same results, same state after every step; the WAL replayed and a
snapshot restored reach the same state)."""

import random

import pytest

from kvservice._proto import allocator_pb2 as pb
from kvservice.allocator import Allocator
from kvservice.allocator.pools import VllmKVCacheManager
from kvservice.commands import PoolSpec, StepRpc, VllmOptions
from kvservice.core import FullAttentionSpec, KVCacheConfig, Request, SlidingWindowSpec
from kvservice.errors import InvalidArgument
from kvservice.hashing import HashSpec
from kvservice.ops import (
    AddRequestOp,
    AllocateBatchOp,
    AllocateOp,
    DecodeBatchOp,
    FreeOp,
    OpStatus,
    ResetPrefixCacheOp,
)
from kvservice.store import wal
from kvservice.store.snapshot import dump, load, state_digest
from kvservice.wire import decode, encode
from tests.core_helpers import pool_state
from tests.service_helpers import SMALL_HASH_BLOCK

BS = SMALL_HASH_BLOCK  # the hash block size of the small_hash_server fixture (conftest.py)
SPEC = HashSpec("sha256", None, BS)


def hashes(tokens: list[int]) -> list[bytes]:
    return Request("h", tokens, BS, hash_spec=SPEC).block_hashes


@pytest.fixture
def client(small_hash_client):
    return small_hash_client


def register(client, pool_id: str, num_blocks: int, watermark: float = 0.0) -> None:
    client.register_pool(pool_id, KVCacheConfig(num_blocks, [FullAttentionSpec(BS)]), max_model_len=256,
                         hash_spec=SPEC, vllm=VllmOptions(watermark))


def admit(request_id: str, tokens: list[int], num_new: int, hit: int = 0, **kw) -> list:
    return [AddRequestOp(request_id, block_hashes=hashes(tokens), num_tokens=len(tokens)),
            AllocateOp(request_id, num_new_tokens=num_new, lookup=True, num_new_computed_tokens=hit, waiting=True,
                       **kw)]


def test_output_placeholders_then_their_hashes_cached(client, request):
    """Async scheduling: slots for tokens not sampled yet, their hashes appended (and blocks cached) later."""
    pid = request.node.name
    register(client, pid, 17)
    prompt = list(range(6))
    r = client.step(pid, admit("a", prompt, 6))
    assert r[1].status == OpStatus.OK and r[1].new_block_ids == ([1, 2],)
    # Step 2 runs before step 1's token is sampled: one placeholder; without it the op is refused.
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=6, num_new_tokens=1)])
    assert r[0].status == OpStatus.FAILED_PRECONDITION and "output placeholders" in r[0].message
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=6, num_new_tokens=1, num_output_placeholders=1,
                                     num_in_flight_tokens=6)])
    assert r[0].status == OpStatus.OK and r[0].new_block_ids == ()  # one group, no new block: none on the wire
    # Step 1's token (6) arrives; step 3 schedules position 7 with step 2's token still a placeholder.
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=7, num_new_tokens=1, num_output_placeholders=1,
                                     num_in_flight_tokens=1, append_block_hashes=[], num_append_tokens=1)])
    assert r[0].status == OpStatus.OK and r[0].num_tokens == 7
    # Step 2's token (7) fills block 1: its hash comes with it, and caching it is vLLM's cache_blocks.
    full = prompt + [6, 7]
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=8, append_block_hashes=hashes(full)[1:2],
                                     num_append_tokens=1, num_in_flight_tokens=1, cache_tokens=7)])
    assert r[0].status == OpStatus.OK and r[0].num_tokens == 8
    assert client.get_stats().pools[pid].num_cached_blocks == 1  # cache_tokens 7: block 1 not yet
    r = client.step(pid, [AllocateOp("a", num_computed_tokens=8, num_in_flight_tokens=0, cache_tokens=8),
                          AllocateOp("a", num_computed_tokens=8, num_new_tokens=1, num_output_placeholders=1)])
    assert [x.status for x in r.results] == [OpStatus.OK, OpStatus.OK] and r[1].new_block_ids == ([3],)
    assert client.get_stats().pools[pid].num_cached_blocks == 2
    # A new request sharing those 8 tokens hits both blocks.
    r = client.step(pid, admit("b", full + [50], 1, hit=8))
    assert r[1].status == OpStatus.OK and r[1].new_block_ids == ([1, 2, 4],) and r[1].num_computed_tokens == 8


def test_the_full_sequence_gate_watermark_and_reserved_blocks(client, request):
    pid = request.node.name
    register(client, pid, 17, watermark=0.25)  # int(0.25 * 17) = 4 blocks kept free for admissions
    r = client.step(pid, admit("running", list(range(100, 140)), 40))  # 10 of 16 blocks
    assert r[1].status == OpStatus.OK and len(r[1].new_block_ids[0]) == 10
    before = client.get_stats(check_invariants=True).pools[pid]
    big = list(range(200, 240))  # 10 blocks: the whole prompt does not fit in the 6 free ones
    r = client.step(pid, admit("big", big, 8, full_sequence_must_fit=True))
    assert r[1].status == OpStatus.NO_SPACE
    r = client.step(pid, [AllocateOp("big", num_new_tokens=8, lookup=True, waiting=True)])  # its first chunk fits
    assert r[0].status == OpStatus.OK and r[0].new_block_ids == ([11, 12],)
    client.free(pid, "big")
    # The watermark: 3 blocks + 4 kept free > 6 while another request is scheduled; fits when none is.
    r = client.step(pid, admit("w", list(range(300, 312)), 12, has_scheduled_reqs=True))
    assert r[1].status == OpStatus.NO_SPACE
    r = client.step(pid, [AllocateOp("w", num_new_tokens=12, lookup=True, waiting=True, has_scheduled_reqs=True,
                                     reserved_blocks=4)])
    assert r[0].status == OpStatus.NO_SPACE  # reserved blocks too: 3 > 6 - 4 (watermark 4 on top)
    after = client.get_stats(check_invariants=True).pools[pid]
    assert after.num_free_blocks == before.num_free_blocks == 6 and after.invariant_violation == ""
    r = client.step(pid, [AllocateOp("w", num_new_tokens=12, lookup=True, waiting=True)])
    assert r[0].status == OpStatus.OK and len(r[0].new_block_ids[0]) == 3
    # A running request's allocation ignores the watermark (vLLM applies it to waiting requests only).
    r = client.step(pid, [AllocateOp("running", num_computed_tokens=40, num_new_tokens=4, append_block_hashes=[],
                                     num_append_tokens=0, has_scheduled_reqs=True, num_output_placeholders=4)])
    assert r[0].status == OpStatus.OK and len(r[0].new_block_ids[0]) == 1


def test_a_stale_hit_and_refused_fields_change_nothing(client, request):
    pid = request.node.name
    register(client, pid, 17)
    prompt = list(range(10))
    client.step(pid, admit("a", prompt, 10))
    before = client.get_stats(check_invariants=True).pools[pid]
    r = client.step(pid, admit("b", prompt + [1], 11, hit=4))  # 8 tokens are cached, not 4
    assert r[1].status == OpStatus.FAILED_PRECONDITION and "has 8 of its tokens cached" in r[1].message
    assert client.get_stats().pools[pid].num_free_blocks == before.num_free_blocks
    with pytest.raises(InvalidArgument) as err:
        client.step(pid, [DecodeBatchOp(["a"], [10], None)])
    assert err.value.field == "ops[0].decode"
    client.register_pool(pid + "-kv", KVCacheConfig(9, [FullAttentionSpec(BS)]), max_model_len=64)
    with pytest.raises(InvalidArgument) as err:
        client.step(pid + "-kv", [AddRequestOp("x", token_ids=[1, 2]),
                                  AllocateOp("x", num_new_tokens=2, lookup=True)])
    assert err.value.field == "ops[1].allocate.lookup"
    # vLLM's reset_prefix_cache: refused while a block is in use, done once none is.
    assert client.step(pid, [ResetPrefixCacheOp()])[0].status == OpStatus.FAILED_PRECONDITION
    r = client.step(pid, [FreeOp("a"), FreeOp("b"), ResetPrefixCacheOp()])
    assert r[2].status == OpStatus.OK and client.get_stats().pools[pid].num_cached_blocks == 0


def test_allocate_batch_rows_are_their_allocate_ops_over_the_wire():
    """Every AllocateOp field a row carries survives packing and the wire (random values, every flag)."""
    rng = random.Random(5)
    ops = []
    for i in range(40):
        hashes_ = [bytes([i, j]) * 16 for j in range(rng.randrange(3))]
        ops.append(AllocateOp(f"r{i}", rng.randrange(200), rng.randrange(200), None, hashes_ if hashes_ else None,
                              rng.randrange(1, 9) if hashes_ else 0, rng.randrange(3), rng.random() < 0.5, False,
                              None, rng.randrange(3), rng.randrange(5), rng.random() < 0.5, False, 0,
                              rng.random() < 0.5, rng.randrange(4), rng.random() < 0.5, rng.randrange(200)))
    batch = AllocateBatchOp.of(ops)
    assert batch.ops() == ops
    spec = PoolSpec("p", KVCacheConfig(64, [FullAttentionSpec(BS)]), 256, hash_spec=SPEC, vllm=VllmOptions(0.0))
    [decoded] = decode.decode_ops(encode.step_request("p", [batch]).ops, spec, BS)
    assert decoded.ops() == ops
    with pytest.raises(ValueError, match="lookup"):
        AllocateBatchOp.of([AllocateOp("a", num_new_tokens=1, lookup=True)])


def test_a_bad_allocate_batch_is_refused_naming_the_row_and_changes_nothing(client, request):
    pid = request.node.name
    register(client, pid, 17)
    client.step(pid, admit("a", list(range(10)), 10))
    before = client.get_stats(check_invariants=True).pools[pid]
    good = AllocateOp("a", num_computed_tokens=10, num_new_tokens=1, num_output_placeholders=1)

    def refused(batch: AllocateBatchOp, pool_id: str = pid) -> InvalidArgument:
        with pytest.raises(InvalidArgument) as err:
            client.step(pool_id, [AllocateBatchOp.of([good]), batch])  # the good row is not applied either
        return err.value

    too_long = AllocateBatchOp.of([good, AllocateOp("a", num_computed_tokens=11, num_new_tokens=300)])
    err = refused(too_long)
    assert err.field == "ops[1].allocate_batch.rows[1].num_new_tokens"
    assert "300: exceeds max_model_len 256" in str(err)
    flags = AllocateBatchOp.of([good])
    flags.rows[-1] = 16
    assert refused(flags).field == "ops[1].allocate_batch.rows[0].flags"
    short = AllocateBatchOp.of([good])
    del short.rows[-1]
    assert refused(short).field == "ops[1].allocate_batch.rows"
    unmatched = AllocateBatchOp.of([good])
    unmatched.append_block_hashes = [bytes(32)]
    assert refused(unmatched).field == "ops[1].allocate_batch.append_block_hashes"
    hashes_only = AllocateBatchOp.of([AllocateOp("a", append_block_hashes=[bytes(32)], num_append_tokens=4)])
    hashes_only.rows[3] = 0  # the row's num_append_tokens
    assert refused(hashes_only).field == "ops[1].allocate_batch.rows[0].num_append_tokens"
    assert refused(AllocateBatchOp([], AllocateBatchOp.of([]).rows)).field == "ops[1].allocate_batch.request_ids"
    client.register_pool(pid + "-kv", KVCacheConfig(9, [FullAttentionSpec(BS)]), max_model_len=64)
    with pytest.raises(InvalidArgument, match="does not follow vLLM's semantics") as err:
        client.step(pid + "-kv", [AllocateBatchOp.of([good])])
    assert err.value.field == "ops[0].allocate_batch"
    after = client.get_stats(check_invariants=True).pools[pid]
    assert (after.num_free_blocks, after.num_cached_blocks) == (before.num_free_blocks, before.num_cached_blocks)
    r = client.step(pid, [AllocateBatchOp.of([good, AllocateOp("zz", num_new_tokens=1)])])[0]
    assert [r.batch.status(0), r.batch.status(1)] == [OpStatus.OK, OpStatus.NOT_FOUND]
    assert r.batch.failures[0].request_id == "zz"


# ---- random traces: the wire against the core called as vLLM's scheduler calls it -----------------------
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


def test_a_cache_op_with_an_allocation_is_the_two_ops(client, request):
    """What RemoteKVCacheManager folds: cache_tokens with num_new_tokens is cache_blocks, then allocate_slots —
    the same blocks, cached blocks and free count as the two ops; a NO_SPACE refuses only the allocation."""
    for crowded in (False, True):
        outcomes = []
        for folded in (False, True):
            pid = f"{request.node.name}-{crowded}-{folded}"
            register(client, pid, 6)  # 5 usable blocks of 4 tokens
            prompt = list(range(7))
            client.step(pid, admit("a", prompt, 7))  # 2 blocks
            if crowded:  # the other 3 blocks taken: a's next block does not fit
                client.step(pid, admit("b", list(range(100, 112)), 12))
            full = prompt + [7]  # step 1's token fills a's block 1
            cache = AllocateOp("a", num_computed_tokens=8, append_block_hashes=hashes(full)[1:2], num_append_tokens=1,
                               cache_tokens=8)
            alloc = AllocateOp("a", num_computed_tokens=8, num_new_tokens=1, num_output_placeholders=1)
            if folded:
                ops = [AllocateOp(**{**vars_of(alloc), "cache_tokens": 8,
                                     "append_block_hashes": cache.append_block_hashes, "num_append_tokens": 1})]
            else:
                ops = [cache, alloc]
            last = client.step(pid, ops).results[-1]
            stats = client.get_stats().pools[pid]
            outcomes.append((last.status, last.new_block_ids, stats.num_cached_blocks, stats.num_free_blocks))
        assert outcomes[0] == outcomes[1]
        assert outcomes[0][0] == (OpStatus.NO_SPACE if crowded else OpStatus.OK)
        assert outcomes[0][2] == (5 if crowded else 2)  # a's 2 blocks cached either way (b's 3 too, crowded)
    with pytest.raises(InvalidArgument, match="cache_tokens"):  # not on an admission
        client.step(f"{request.node.name}-True-True", [AllocateOp("z", num_new_tokens=1, lookup=True, cache_tokens=1)])


def vars_of(op: AllocateOp) -> dict:
    return {f: getattr(op, f) for f in AllocateOp.__dataclass_fields__}
