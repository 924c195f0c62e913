"""Random scheduler-like sequences over small pools; the block invariants after every step."""

import copy

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvservice.core import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    MambaSpec,
    Request,
    SlidingWindowSpec,
)
from kvservice.core.invariants import check_invariants
from tests.core_helpers import pool_state

CONFIGS = {
    "full": [FullAttentionSpec(4)],
    "full+sw": [FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=6)],
    "full+mamba8": [FullAttentionSpec(4), MambaSpec(8)],
}
MAX_MODEL_LEN = 64
FAMILIES = [list(range(100 * f, 100 * f + 64)) for f in range(3)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(sorted(CONFIGS)), num_blocks=st.integers(6, 24), dcp=st.sampled_from([1, 1, 2]))
    def setup(self, config, num_blocks, dcp):
        specs = CONFIGS[config]
        if dcp > 1 and config != "full":
            dcp = 1
        self.m = KVCacheManager(KVCacheConfig(num_blocks, specs), MAX_MODEL_LEN, enable_events=True,
                                dcp_world_size=dcp)
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.next_id = 0

    def _new_id(self):
        self.next_id += 1
        return f"r{self.next_id}"

    def _allocate(self, req, num_new, num_hit=0, hits=None, lookahead=0):
        before = copy.deepcopy(self.m)
        total = min(req.num_computed_tokens + num_hit, MAX_MODEL_LEN)
        new = self.m.allocate_slots(req, num_new, num_hit, hits, lookahead)
        if new is None:
            # Nothing changed beyond the one exception: skipped blocks may already be freed.
            before.remove_skipped_blocks(req.request_id, total, req.num_prompt_tokens)
            assert pool_state(self.m) == pool_state(before)
        return new

    @rule(family=st.integers(0, 2), length=st.integers(1, 40), salt=st.sampled_from([None, None, "s"]))
    def add(self, family, length, salt):
        rid = self._new_id()
        self.waiting[rid] = Request(rid, FAMILIES[family][:length], self.m.hash_block_size, cache_salt=salt)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        req = self.waiting[rid]
        hits, num_hit = self.m.get_computed_blocks(req)
        assert num_hit < req.num_tokens and num_hit % self.m.cache_hit_alignment_tokens == 0
        num_new = data.draw(st.integers(1, req.num_tokens - num_hit))
        if self._allocate(req, num_new, num_hit, hits) is not None:
            req.num_computed_tokens = num_hit + num_new
            self.running[rid] = self.waiting.pop(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), lookahead=st.integers(0, 3))
    def advance(self, data, lookahead):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        if req.num_tokens >= MAX_MODEL_LEN:
            return
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids(data.draw(st.integers(0, 300)))
        num_new = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
        if self._allocate(req, num_new, lookahead=lookahead) is not None:
            req.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if parent.num_computed_tokens != parent.num_tokens:
            return
        child = self.m.fork(parent, self._new_id())
        assert self.m.get_block_ids(child.request_id) == self.m.get_block_ids(parent.request_id)
        self.running[child.request_id] = child

    @rule()
    def take_copies(self):
        for src, dst in self.m.take_block_copies():
            assert src != dst and dst != 0

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        self.m.free(req)
        assert self.m.get_block_ids(rid) == tuple([] for _ in self.m.config.groups)
        if preempt:
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            self.waiting[rid] = req

    @rule()
    def reset(self):
        ok = self.m.reset_prefix_cache()
        assert ok == (self.m.block_pool.get_num_free_blocks() == self.m.block_pool.num_blocks - 1)

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "m"):
            check_invariants(self.m)

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for req in list(self.running.values()):
            self.m.free(req)
        self.m.take_block_copies()
        check_invariants(self.m)
        assert self.m.block_pool.get_num_free_blocks() == self.m.block_pool.num_blocks - 1


SchedulerMachine.TestCase.settings = settings(stateful_step_count=40)
TestScheduler = SchedulerMachine.TestCase
