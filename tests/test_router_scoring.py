"""The router's scoring formula, ranking, consistent hashing and backend parsing (pure functions: no process)."""

from __future__ import annotations

import json

import pytest

from kvservice.router.backends import Backend, backends_from_data, parse_backend
from kvservice.router.fleet import parse_load
from kvservice.router.scoring import Calibration, Load, Reuse, ScoringWeights, estimate, rank, rendezvous
from kvservice.router.settings import RouterSettings

W = ScoringWeights(prefill_tokens_per_s=1000, kv_bytes_per_token=1_000_000, cpu_gbps=4, ram_gbps=10, disk_gbps=1,
                   remote_gbps=5, waiting_s=0.5, running_s=0.1, kv_usage_s=2.0)


def test_the_formula_costs_each_part():
    e = estimate(2000, Reuse(engine=1000), Load(running=2, waiting=1, kv_usage=0.5), W)
    assert e.cached_tokens == e.engine_tokens == 1000 and e.loaded_tokens == 0 and e.load_from == ""
    assert e.compute_s == pytest.approx(1.0) and e.queue_s == pytest.approx(0.5 + 0.2 + 1.0)
    assert e.ttft_s == pytest.approx(2.7)
    # the connector loads the longest store hit past the engine's own: 1500 - 1000 tokens from RAM at 10 GB/s
    e = estimate(2000, Reuse(engine=1000, ram=1500, disk=1200, remote=1400), Load(), W)
    assert (e.load_from, e.loaded_tokens, e.cached_tokens) == ("ram", 500, 1500)
    assert e.load_s == pytest.approx(500 * 1e6 / 10e9) and e.compute_s == pytest.approx(0.5)
    # the longest wins even on a slower tier (that is what the connector takes); ties go RAM, disk, remote
    assert estimate(2000, Reuse(disk=1600, ram=1500), Load(), W).load_from == "disk"
    assert estimate(2000, Reuse(disk=1600, remote=1600), Load(), W).load_from == "disk"
    assert estimate(2000, Reuse(cpu=1600, ram=1600), Load(), W).load_from == "cpu"
    # stores=False: the engine's own cache alone (the `precise` policy, or an engine without the connector)
    e = estimate(2000, Reuse(engine=100, ram=1900), Load(), W, stores=False)
    assert e.cached_tokens == 100 and e.compute_s == pytest.approx(1.9)
    # hits longer than the prompt are capped at it
    assert estimate(10, Reuse(engine=50), Load(), W).cached_tokens == 10


def test_the_rates_are_learned_from_what_replies_took():
    rates = Calibration(W, alpha=0.5, min_samples=2, min_tokens=100)
    loads_from_ram = Reuse(engine=0, ram=1500)
    # the settings' rates until a rate has its samples: 1 ms per prefilled token, 0.1 ms per RAM token
    e = estimate(2000, loads_from_ram, Load(waiting=1), W, rates=rates)
    assert e.ttft_s == pytest.approx(0.5 + 0.15 + 0.5) and e.computed_tokens == 500
    # prefills of 1,000 tokens took 3 s past their 0.5 s queue: 3 ms a token, once two said so
    cold = estimate(1000, Reuse(), Load(waiting=1), W, rates=rates)
    rates.observe(cold, 3.5)
    assert rates.prefill_seconds_per_token() == pytest.approx(1e-3)  # one sample: still the setting
    rates.observe(cold, 3.5)
    assert rates.prefill_seconds_per_token() == pytest.approx(3e-3)
    rates.observe(estimate(50, Reuse(), Load(), W, rates=rates), 9.0)  # 50 tokens: a step's cost, not a rate
    assert rates.prefill_seconds_per_token() == pytest.approx(3e-3)
    # loads of 1,500 RAM tokens whose replies took 2.0 s with 0.5 s queued and 500 tokens prefilled (1.5 s at
    # the rate learned): the load took 0.0 s; then 3.5 s: 1.5 s, 1 ms a token; the mean (alpha 0.5) of the two
    rates.observe(e, 2.0)
    rates.observe(e, 3.5)
    assert rates.load_seconds_per_token("ram") == pytest.approx(0.5e-3)
    assert rates.load_seconds_per_token("disk") == pytest.approx(W.load_seconds_per_token("disk"))  # no samples
    # an engine holding the prompt itself now beats one that would load it, which the settings ranked first
    own = Reuse(engine=1300)
    assert estimate(2000, own, Load(), W).ttft_s > estimate(2000, loads_from_ram, Load(), W).ttft_s
    assert estimate(2000, own, Load(), W, rates=rates).ttft_s < estimate(2000, loads_from_ram, Load(), W,
                                                                         rates=rates).ttft_s
    with pytest.raises(ValueError, match="alpha"):
        Calibration(W, alpha=0)


def test_a_loaded_engine_loses_to_an_idle_one_with_less_cached():
    busy = estimate(4000, Reuse(engine=4000), Load(waiting=8), W)
    idle = estimate(4000, Reuse(engine=2000), Load(), W)
    assert rank({"busy": busy, "idle": idle}) == ["idle", "busy"]


def test_rank_breaks_ties_by_preference_then_the_prompt():
    same = estimate(100, Reuse(), Load(), W)
    names = {n: same for n in ("a", "b", "c")}
    assert rank(names, spread=0) == ["a", "b", "c"]
    assert rank(names, spread=1) == ["b", "c", "a"]
    assert rank(names, prefer="c", spread=1)[0] == "c"
    worse = estimate(100, Reuse(), Load(waiting=1), W)
    assert rank({"a": worse, "b": same}, prefer="a") == ["b", "a"]  # a preference never beats a better estimate
    assert rank({}) == []


def test_rendezvous_moves_only_the_removed_engines_keys():
    names = [f"e{i}" for i in range(5)]
    keys = [f"user-{i}".encode() for i in range(200)]
    before = {k: rendezvous(k, names)[0] for k in keys}
    after = {k: rendezvous(k, [n for n in names if n != "e2"])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "e2"} and moved
    assert {k: rendezvous(k, names)[1] for k in moved} == {k: after[k] for k in moved}  # next in its order
    assert len(set(before.values())) == 5  # spread over all


def test_weights_and_settings_name_a_bad_field():
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be > 0, got 0"):
        ScoringWeights(prefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="pd_skip_fraction must be in"):
        RouterSettings(pd_skip_fraction=1.5)
    with pytest.raises(ValueError, match="policy 'fastest' is none of"):
        RouterSettings(policy="fastest")


def test_backends_from_flags_and_files():
    b = parse_backend("e0=http://10.0.0.1:8000/,pool=ext-0,node=node-a,role=kv_consumer")
    assert b == Backend("e0", "http://10.0.0.1:8000", "ext-0", "node-a", "decode", True)
    assert b.store_pools == ("kvstore:node-a", "kvdisk:node-a") and b.decodes
    plain = parse_backend("e1=http://h:1")
    assert plain.pool == "e1" and plain.role == "both" and plain.connector is False
    for text, match in (("e0", "wants NAME=URL"), ("e0=ftp://h", "not http"), ("e0=http://h,colour=red", "KEY one of"),
                        ("e0=http://h,role=boss", "role 'boss'"), ("e0=http://h,connector=maybe", "connector=")):
        with pytest.raises(ValueError, match=match):
            parse_backend(text)
    data = json.loads('{"backends": [{"name": "a", "url": "http://h:1", "node": "n1"}, {"name": "b", "url": '
                      '"http://h:2", "role": "prefill", "connector": true}]}')
    a, p = backends_from_data(data)
    assert a.connector and a.pool == "a" and p.role == "prefill"
    for bad, match in (({"backends": [{"name": "a"}]}, "needs a name and a url"), ([{"name": "a", "url": "http://h",
                        "weight": 2}], "unknown key"), ([{"name": "a", "url": "http://h"}] * 2, "repeat"),
                       ("x", "a list of backends")):
        with pytest.raises(ValueError, match=match):
            backends_from_data(bad)


def test_vllm_load_gauges_are_read_off_its_metrics_page():
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\nvllm:kv_cache_usage_perc{engine="1"} 0.75\n'
            'vllm:num_requests_waiting_by_reason{reason="x"} 9\nvllm:prompt_tokens_total 5\n')
    assert parse_load(text) == Load(running=4.0, waiting=2.0, kv_usage=0.5)
