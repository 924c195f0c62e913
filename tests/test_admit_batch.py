"""AdmitBatchOp is packed AddRequestOp + AllocateOp pairs: random traces through two allocators, one
admitting with AdmitBatchOps and one with the pairs they stand for, must give the same outcome per
entry and equal state (block for block, free-queue order, index, events) after every step."""

import random
import zlib

import pytest

from kvservice.allocator.keys import client_request_id
from kvservice.ops import AddRequestOp, AdmitBatchOp, AllocateOp, DecodeBatchOp, FreeOp, OpStatus
from kvservice.store.snapshot import encode_state
from tests.test_decode_batch_path import CASES, make


def admissions(rng: random.Random, live: set[str], next_id: list[int], max_len: int):
    """(AdmitBatchOp, the pairs it stands for): new ids, some repeated or already live, shared prefixes,
    budgets from nothing to the whole prompt, some salts and LoRA names."""
    family = [rng.randrange(50) for _ in range(24)]
    ids, prompts, budgets, salts, loras = [], [], [], [], []
    for _ in range(rng.randint(1, 4)):
        if live and rng.random() < 0.15:
            rid = rng.choice(sorted(live))  # ALREADY_EXISTS
        elif ids and rng.random() < 0.1:
            rid = ids[-1]  # twice in one batch
        else:
            rid = f"r{next_id[0]}"
            next_id[0] += 1
        prompt = family[:rng.randint(1, 24)] + [rng.randrange(50) for _ in range(rng.randint(0, 8))]
        if rng.random() < 0.05:
            prompt = [1] * rng.randint(max_len // 2, max_len)  # may not fit: NO_SPACE
        ids.append(rid)
        prompts.append(prompt)
        budgets.append(rng.choice([len(prompt), len(prompt), rng.randint(0, len(prompt))]))
        salts.append(rng.choice([None, None, "s"]))
        loras.append(rng.choice([None, None, "l"]))
    whole = rng.random() < 0.5  # num_new_tokens omitted: each whole prompt
    lookahead = rng.choice([0, 0, 2])
    op = AdmitBatchOp(ids, prompts, None if whole else budgets, lookahead,
                      salts if rng.random() < 0.5 else None, loras if rng.random() < 0.5 else None)
    pairs, seen = [], set(live)
    for i, rid in enumerate(ids):
        pairs.append(AddRequestOp(rid, token_ids=prompts[i], cache_salt=op.cache_salts[i] if op.cache_salts else None,
                                  lora_name=op.lora_names[i] if op.lora_names else None))
        if rid not in seen:  # an entry whose add fails schedules nothing
            pairs.append(AllocateOp(rid, num_new_tokens=len(prompts[i]) if whole else budgets[i],
                                    num_lookahead_tokens=lookahead))
        seen.add(rid)
    return op, pairs


def expanded(op: AdmitBatchOp, packed, pair_results):
    """Per entry, the outcome the packed result reports and the one its pair reported."""
    batch = packed.batch
    failures = iter(batch.failures)
    tables = batch.block_ids()
    results = iter(pair_results)
    out = []
    for i, rid in enumerate(op.request_ids):
        add = next(results)
        pair = add if add.status != OpStatus.OK else next(results)
        if batch.status(i) == OpStatus.OK:
            got = (OpStatus.OK, tables[i], batch.num_computed_tokens[i], batch.num_scheduled_tokens[i])
            want = (pair.status, tuple(pair.new_block_ids) or ([],), pair.num_computed_tokens,
                    pair.num_scheduled_tokens)
            if len(want[1]) != batch.num_groups:  # nothing scheduled: the pair's result shows one empty group
                want = (want[0], tuple([] for _ in range(batch.num_groups)), want[2], want[3])
        else:
            got, want = next(failures), pair
        out.append((rid, got, want))
    return out


def pools(allocator) -> list[bytes]:
    """Every pool's state, block for block (the snapshot encoding)."""
    return [p.SerializeToString(deterministic=True) for p in encode_state(allocator).pools]


@pytest.mark.parametrize("quota", [False, True], ids=["no quota", "tenant quota"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_admit_batch_equals_add_allocate_pairs(case, quota):
    cfg = CASES[case]
    packed, s1 = make(True, cfg, quota)
    pairs, s2 = make(True, cfg, quota)
    if quota:  # a quota the traces run into
        packed.state.usage.quotas["q"] = pairs.state.usage.quotas["q"] = cfg["blocks"] // 2
    rng = random.Random(zlib.crc32(f"admit/{case}/{quota}".encode()))
    live: dict[str, int] = {}
    next_id = [0]
    outcomes = set()
    for step in range(300):
        if live and rng.random() < 0.4:
            ids = rng.sample(sorted(live), rng.randint(1, len(live)))
            ops = rng.choice([[FreeOp(r) for r in ids], [DecodeBatchOp(ids, [live[r] for r in ids], [7] * len(ids))]])
            r1, r2 = s1.step("p", ops), s2.step("p", ops)
            assert r1 == r2
        else:
            op, pair_ops = admissions(rng, set(live), next_id, cfg["max_len"])
            r1 = s1.step("p", [op])
            r2 = s2.step("p", pair_ops)
            assert len(r1.results) == 1 and r1.copies == r2.copies
            for rid, got, want in expanded(op, r1.results[0], r2.results):
                assert got == want, f"step {step}, entry {rid}: {op}"
                outcomes.add(got[0] if isinstance(got, tuple) else got.status)
        assert pools(packed) == pools(pairs), f"step {step}"  # the sessions' last replies differ in shape
        ev1, ev2 = packed.state.events, pairs.state.events
        assert [(e.sequence, e.event) for e in ev1.since(ev1.oldest_sequence)] == \
            [(e.sequence, e.event) for e in ev2.since(ev2.oldest_sequence)]
        assert packed.invariant_violation(packed.pool("p")) == ""
        live = {client_request_id(k): req.num_tokens for k, req in packed.pool("p").requests.items()}
    assert {OpStatus.OK, OpStatus.ALREADY_EXISTS} <= outcomes
    assert outcomes & {OpStatus.NO_SPACE, OpStatus.RESOURCE_EXHAUSTED}
