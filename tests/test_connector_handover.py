"""Prefill/decode hand-over through the connector's two sides: a consumer handed the producer's
kv_transfer_params waits for its pages (an asynchronous load) until they are committed; params a client
forged are ignored; an aborted or timed-out wait is reported so vLLM frees or recomputes the blocks. And the
other way a request's blocks outlive it: a finished request whose save is in flight is reported to vLLM
(finished_sending) once the save settles."""

# ruff: noqa: F811 - the fixtures `server` and `store` come from connector_helpers

from __future__ import annotations

import time

import torch

from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
from kvservice.integrations.vllm.connector.worker_side import WorkerSide
from tests.connector_helpers import (  # noqa: F401 - server, store: the module's fixtures
    BS,
    HEAD,
    NUM_BLOCKS,
    idle,
    kv,
    report,
    request,
    save_prompt,
    scheduled,
    server,
    settings,
    store,
    worker,
)


def test_a_handoff_waits_for_the_producers_pages(server, store):
    """Prefill/decode: the consumer is handed the producer's kv_transfer_params before the producer's worker
    reported its save. It claims the whole blocks as an asynchronous load, pins them once committed, and
    vLLM hears the load finished; a hand-over whose pages never come fails after handoff_timeout_s."""
    producer = worker(server, store, "p", 50)
    p_sched = SchedulerSide(settings(server, store, index=False), BS, "p", loads=False, saves=True)
    prompt = list(range(400, 414))
    save_prompt(server, store, p_sched, [producer], "r", prompt, [1, 2, 3, 4])
    params = p_sched.finished(request("r", prompt))
    consumer = SchedulerSide(settings(server, store, index=False, store=None), BS, "c", loads=True, saves=False)
    consumer.on_new_request(request("x", prompt, params))
    assert consumer.num_new_matched_tokens(request("x", prompt, params), 0) == (12, True)
    consumer.after_alloc(request("x", prompt, params), [5, 6, 7, 8], 12)
    loads, _ = consumer.build(idle())
    assert loads == []  # not committed yet: it waits
    report(p_sched, producer)  # the producer's worker reports the save: committed
    deadline = time.monotonic() + 5
    while not loads and time.monotonic() < deadline:
        time.sleep(0.03)
        loads, _ = consumer.build(idle())
    (load,) = loads
    assert load.async_load and load.local_block_ids == [5, 6, 7] and consumer.loaded["x"] == 12
    reader_kv = kv(51)
    reader = WorkerSide(settings(server, store, store=None), BS, "c", head_size=HEAD)
    reader.register(reader_kv, NUM_BLOCKS)
    reader.load([load])
    assert reader.finished(set()) == (None, {"x"}) and not reader.take_failed_blocks()
    for name, t in kv(50).items():  # the producer's KV
        assert torch.equal(reader_kv[name][[5, 6, 7]], t[[1, 2, 3]])
    late = SchedulerSide(settings(server, store, index=False, store=None, handoff_timeout_s=0.2), BS, "l",
                         loads=True, saves=False)
    never = {"kvservice": {"pool_id": store.pool_id, "num_tokens": 12}}
    other = list(range(900, 914))
    late.on_new_request(request("y", other, never))
    assert late.num_new_matched_tokens(request("y", other, never), 0) == (12, True)
    late.after_alloc(request("y", other, never), [9, 10, 11, 12], 12)
    time.sleep(0.3)
    (gave_up,), _ = late.build(idle())
    assert gave_up.failed == "timeout" and gave_up.async_load
    reader.load([gave_up])
    assert reader.take_failed_blocks() == {9, 10, 11} and reader.finished(set()) == (None, {"y"})
    for side in (producer, p_sched, consumer, reader, late):
        side.close()


def test_a_handoff_already_committed_loads_in_its_own_step(server, store):
    """The producer's save is committed when the consumer asks: the hand-over is pinned at once and answered as
    a synchronous load (loaded in start_load_kv before this step's forward), not an asynchronous one vLLM would
    compute a step later."""
    producer = worker(server, store, "p", 52)
    p_sched = SchedulerSide(settings(server, store, index=False), BS, "p", loads=False, saves=True)
    prompt = list(range(600, 614))
    save_prompt(server, store, p_sched, [producer], "r", prompt, [1, 2, 3, 4])
    report(p_sched, producer)  # committed before the consumer hears of it
    params = p_sched.finished(request("r", prompt))
    consumer = SchedulerSide(settings(server, store, index=False, store=None), BS, "c", loads=True, saves=False)
    consumer.on_new_request(request("x", prompt, params))
    assert consumer.num_new_matched_tokens(request("x", prompt, params), 0) == (12, False)
    assert consumer.num_new_matched_tokens(request("x", prompt, params), 4) == (8, False)  # asked again
    consumer.after_alloc(request("x", prompt, params), [5, 6, 7, 8], 8)
    (load,), _ = consumer.build(scheduled("x", prompt, [5, 6, 7, 8], 12, 2))
    assert not load.async_load and load.local_block_ids == [6, 7] and consumer.loaded["x"] == 8
    reader_kv = kv(53)
    reader = WorkerSide(settings(server, store, store=None), BS, "c", head_size=HEAD)
    reader.register(reader_kv, NUM_BLOCKS)
    reader.load([load])
    assert reader.finished(set()) == (None, None) and not reader.take_failed_blocks()
    for name, t in kv(52).items():
        assert torch.equal(reader_kv[name][[6, 7]], t[[2, 3]])
    report(consumer, reader)
    assert consumer.claim_parts.snapshot()["n1"]["pin_n"] == 1 and not consumer.pins_out
    for side in (producer, p_sched, consumer, reader):
        side.close()


def test_kv_transfer_params_from_a_client_are_checked(server, store):
    """A client's kv_transfer_params that name no store pool or no positive token count are ignored (no
    hand-over, no claim that vLLM would assert on), and a hand-over claiming nothing answers (0, False)."""
    side = SchedulerSide(settings(server, store, index=False), BS, "c", loads=True, saves=False)
    prompt = list(range(1, 30))
    for bad in ({"kvservice": {"pool_id": 7, "num_tokens": 8}}, {"kvservice": {"pool_id": "kvstore:n1"}},
                {"kvservice": {"pool_id": "kvstore:n1", "num_tokens": "8"}}, {"kvservice": "x"}, ["x"],
                {"kvservice": {"pool_id": "other:n1", "num_tokens": 8}}):
        side.on_new_request(request("r", prompt, bad))
        assert side.tracked["r"].handoff is None, bad
    side.on_new_request(request("s", prompt, {"kvservice": {"pool_id": "kvstore:n1", "num_tokens": 8}}))
    assert side.num_new_matched_tokens(request("s", prompt), 8) == (0, False)  # the engine has them already
    side.close()


def test_an_aborted_handoff_is_reported_so_vllm_frees_it(server, store):
    side = SchedulerSide(settings(server, store, index=False, store=None), BS, "c", loads=True, saves=False)
    prompt = list(range(1, 30))
    params = {"kvservice": {"pool_id": store.pool_id, "num_tokens": 24}}
    side.on_new_request(request("h", prompt, params))
    assert side.num_new_matched_tokens(request("h", prompt, params), 0) == (24, True)
    side.after_alloc(request("h", prompt, params), [1, 2, 3, 4, 5, 6, 7, 8], 24)
    side.finished(request("h", prompt))  # aborted while it waited
    (load,), _ = side.build(idle())
    assert load.async_load and load.failed == "aborted"
    w = worker(server, store, "c", 47, store=None)
    w.load([load])
    assert w.finished(set()) == (None, {"h"})
    for s in (side, w):
        s.close()


def test_a_delayed_request_is_reported_once_its_saves_settle(server, store):
    """vLLM keeps a finished request's blocks while a save of it is in flight (a GPU's): the worker reports
    it in finished_sending once its saves on this rank are sealed, or at once when it had none here."""
    w = worker(server, store, "w", 48)
    sched = SchedulerSide(settings(server, store, index=False), BS, "w", loads=True, saves=True)
    prompt = list(range(40, 53))
    sched.on_new_request(request("r", prompt))
    _, saves = sched.build(scheduled("r", prompt, [1, 2, 3, 4], 0, len(prompt)))
    assert sched.saving("r")
    w.delay(["never-saved-here"])
    assert w.finished(set())[0] == {"never-saved-here"}
    w._saves_of["r"] = {saves[0].save_id}  # noqa: SLF001 - as if its copy were in flight on this rank
    w.delay(["r"])
    assert w.finished(set())[0] is None
    w.save(saves)
    w.flush()
    assert w.finished(set())[0] == {"r"}
    for s in (w, sched):
        s.close()
