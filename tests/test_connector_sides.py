"""KVServiceConnector's two sides without vLLM (the engine tests run them inside vLLM): the scheduler side
against a real server and store, fed what vLLM's scheduler gives it; the worker sides (one per tensor-parallel
rank) copying pages between KV tensors laid out as vLLM's CPU attention lays them out and a store's segment,
reporting what they did (`Done`) back to the scheduler side, which commits and unpins. The failure paths end in
blocks reported failed (vLLM recomputes them), never in pages read from memory that may have been reused.
The page checks are test_connector_page_checks.py's, the prefill/decode hand-over test_connector_handover.py's."""

# ruff: noqa: F811 - the fixtures `server` and `store` come from connector_helpers

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvservice.blockstore import BlockStore
from kvservice.blockstore.segment import TAG
from kvservice.integrations.vllm.connector.plan import Load, Save
from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.worker_side import WorkerSide
from tests.connector_helpers import (  # noqa: F401 - server, store: the module's fixtures
    BS,
    HEAD,
    NUM_BLOCKS,
    PAGE,
    kv,
    report,
    request,
    save_prompt,
    scheduled,
    sealed_page,
    server,
    settings,
    store,
    worker,
)


def test_pages_round_trip_between_engines_through_the_store(server, store):
    """Engine A saves a prompt; engine B (other KV memory, other block ids) loads it: B's blocks hold A's KV
    (the CPU layout converted to canonical pages and back), B's other blocks are untouched, and the pin is
    released once B's worker reported the load."""
    a_kv = kv(1)
    a = WorkerSide(settings(server, store), BS, "a", head_size=HEAD)
    a.register(a_kv, NUM_BLOCKS)
    assert a.page_bytes == PAGE and a.fmt.canonical
    a_sched = SchedulerSide(settings(server, store), BS, "a", loads=True, saves=True)
    prompt = list(range(1, 15))  # 3 whole blocks + 2
    saves = save_prompt(server, store, a_sched, [a], "r", prompt, [5, 6, 7, 8])
    assert len(saves) == 1 and saves[0].local_block_ids == [5, 6, 7]
    assert a_sched.has_pending_work()  # not committed before the worker reports it
    report(a_sched, a)
    assert not a_sched.has_pending_work()
    assert a_sched.finished(request("r", prompt)) == {"kvservice": {"pool_id": store.pool_id, "num_tokens": 12}}
    b_sched = SchedulerSide(settings(server, store), BS, "b", loads=True, saves=True)
    mine = prompt[:12] + [99, 98, 97]
    b_sched.on_new_request(request("s", mine))
    assert b_sched.num_new_matched_tokens(request("s", mine), 0) == (12, False)
    assert b_sched.num_new_matched_tokens(request("s", mine), 0) == (12, False)  # asked again: the same pin
    assert b_sched.num_pins == 1
    b_sched.after_alloc(request("s", mine), [9, 2, 11, 4], 12)
    (load,), saves = b_sched.build(scheduled("s", mine, [9, 2, 11, 4], 12, 3))
    assert load.local_block_ids == [9, 2, 11] and not saves  # every whole block was loaded: not saved again
    b_kv = kv(2)
    b = WorkerSide(settings(server, store), BS, "b", head_size=HEAD)
    b.register(b_kv, NUM_BLOCKS)
    before = {name: t.clone() for name, t in b_kv.items()}
    b.load([load])
    assert not b.take_failed_blocks()
    for name in a_kv:
        assert torch.equal(b_kv[name][[9, 2, 11]], a_kv[name][[5, 6, 7]])
        untouched = [i for i in range(NUM_BLOCKS) if i not in (9, 2, 11)]
        assert torch.equal(b_kv[name][untouched], before[name][untouched])
    with server.client(hash_block_size=BS) as c:
        free = c.get_stats().pools[store.pool_id].num_free_blocks  # the 3 pinned pages are not evictable
        report(b_sched, b)
        assert c.get_stats().pools[store.pool_id].num_free_blocks == free + 3  # unpinned once reported
    assert b.counters.total("loaded") == 3 and b_sched.counters.total("claimed_tokens") == 12
    for side in (a, b, a_sched, b_sched):
        side.close()


def test_a_save_commits_only_once_every_tensor_parallel_rank_wrote_its_slice(server, tmp_path):
    """TP=2: a store page holds both ranks' slices; rank 0's report alone commits nothing, both do. Two other
    ranks then load: each gets its own rank's blocks. A TP=1 engine refuses those pages (another size)."""
    store = BlockStore("tp", server.target, 32, 2 * PAGE, BS, directory=str(tmp_path))
    try:
        kvs = [kv(10), kv(11)]
        ranks = []
        for rank in (0, 1):
            w = WorkerSide(settings(server, store, store="tp"), BS, "t", rank=rank, world_size=2, head_size=HEAD)
            w.register(kvs[rank], NUM_BLOCKS)
            ranks.append(w)
        sched = SchedulerSide(settings(server, store, store="tp", index=False), BS, "t", loads=True, saves=True,
                              world_size=2)
        prompt = list(range(200, 213))
        save_prompt(server, store, sched, ranks, "r", prompt, [1, 2, 3, 4])
        report(sched, ranks[0])  # rank 1 has not reported yet
        reader = SchedulerSide(settings(server, store, store="tp", index=False), BS, "u", loads=True, saves=False,
                               world_size=2)
        reader.on_new_request(request("x", prompt))
        assert reader.num_new_matched_tokens(request("x", prompt), 0) == (0, False)  # not committed
        report(sched, ranks[1])
        assert reader.num_new_matched_tokens(request("x", prompt), 0) == (12, False)
        reader.after_alloc(request("x", prompt), [7, 8, 9, 10], 12)
        (load,), _ = reader.build(scheduled("x", prompt, [7, 8, 9, 10], 12, 1))
        targets = [kv(20), kv(21)]
        for rank in (0, 1):
            w = WorkerSide(settings(server, store, store="tp"), BS, "u", rank=rank, world_size=2, head_size=HEAD)
            w.register(targets[rank], NUM_BLOCKS)
            w.load([load])
            assert not w.take_failed_blocks()
            for name in kvs[rank]:
                assert torch.equal(targets[rank][name][[7, 8, 9]], kvs[rank][name][[1, 2, 3]])
            w.close()
        single = WorkerSide(settings(server, store, store="tp"), BS, "v", head_size=HEAD)
        single.register(kv(30), NUM_BLOCKS)
        single.load([load])
        assert single.take_failed_blocks() == {7, 8, 9}
        assert single.counters.totals["failed"] == {"tp|format": 3}
        for side in (*ranks, single, sched, reader):
            side.close()
    finally:
        store.close()


def test_a_consumer_with_no_store_reads_this_nodes_store_through_shared_memory(server, store):
    """No `store` (an engine that only loads), outside Ray: a store on this node is still read from its
    segment (it went to Ray before, and failed without it)."""
    a, pages, load = sealed_page(server, store)
    consumer = worker(server, store, "b", 44, store=None)
    consumer.load([load])
    assert not consumer.take_failed_blocks() and consumer.stores.num_local_reads == 1
    a.close()
    consumer.close()


def test_a_store_that_stopped_fails_the_load(server, tmp_path):
    store = BlockStore("n1", server.target, 32, PAGE, BS, directory=str(tmp_path))
    a, pages, load = sealed_page(server, store)
    b = worker(server, store, "b", 45)
    b.stores.local("n1", store.generation)  # mapped while it ran
    store.close()
    b.load([load])
    assert b.take_failed_blocks() == {5, 6, 7}
    a.close()
    b.close()


def test_without_the_allocator_nothing_is_found_and_sharing_pauses(tmp_path):
    side = SchedulerSide(ConnectorSettings(address="127.0.0.1:1", store="n1", timeout_s=0.2, retry_after_s=30),
                         BS, "x", loads=True, saves=True)
    prompt = list(range(1, 30))
    side.on_new_request(request("r", prompt))
    assert side.num_new_matched_tokens(request("r", prompt), 0) == (0, False)
    assert side.num_failures == 1 and not side.available()
    side.on_new_request(request("q", prompt))
    assert side.num_new_matched_tokens(request("q", prompt), 0) == (0, False) and side.num_failures == 1
    side.close()


def test_settings_name_the_bad_key():
    with pytest.raises(ValueError, match="address: required"):
        ConnectorSettings.from_extra({})
    with pytest.raises(ValueError, match="unknown key 'adress'"):
        ConnectorSettings.from_extra({"adress": "x"})
    with pytest.raises(ValueError, match="timeout_s: -1"):
        ConnectorSettings.from_extra({"address": "x", "timeout_s": -1})
    with pytest.raises(ValueError, match="load_failure: 'ignore'"):
        ConnectorSettings.from_extra({"address": "x", "load_failure": "ignore"})
    assert ConnectorSettings.from_extra({"address": "x", "stores": "a,b"}).stores == ("a", "b")


def test_a_layout_with_blocks_elsewhere_is_refused():
    side = WorkerSide(ConnectorSettings(address="x"), BS, "w", head_size=HEAD)
    with pytest.raises(ValueError, match="l0"):
        side.register({"l0": torch.zeros(2, NUM_BLOCKS, 4)}, NUM_BLOCKS)


def test_a_hit_asked_again_answers_and_loads_from_the_engines_new_hit(server, store):
    """vLLM asks again when it could not admit the request; the engine's own hit may have shrunk meanwhile:
    the answer and the load follow the last ask (every block past the engine's hit is loaded)."""
    a = worker(server, store, "a", 5)
    writer = SchedulerSide(settings(server, store, index=False), BS, "a", loads=True, saves=True)
    prompt = list(range(40, 57))  # 4 whole blocks + 1
    save_prompt(server, store, writer, [a], "w", prompt, [1, 2, 3, 4, 5])
    report(writer, a)
    reader = SchedulerSide(settings(server, store, index=False), BS, "b", loads=True, saves=False)
    reader.on_new_request(request("r", prompt))
    assert reader.num_new_matched_tokens(request("r", prompt), 8) == (8, False)  # the engine had 2 blocks
    assert reader.num_new_matched_tokens(request("r", prompt), 0) == (16, False)  # ...then none (evicted)
    reader.after_alloc(request("r", prompt), [6, 7, 8, 9, 10], 16)
    (load,), _ = reader.build(scheduled("r", prompt, [6, 7, 8, 9, 10], 16, 1))
    assert load.local_block_ids == [6, 7, 8, 9] and len(load.store_block_ids) == 4
    for side in (a, writer, reader):
        side.close()


def test_no_save_copies_the_blocks_of_a_request_whose_load_failed(server, store):
    """The load fails in one step; the prompt completes in a later one (async scheduling schedules it before
    vLLM hears of the failure): its save is dropped (reported failed: the pages are freed, uncached)."""
    side = worker(server, store, "w", 6)
    side.load([Load("r", store.pool_id, "gone", store.generation, [1], [3])])
    assert side.take_failed_blocks() == {3}
    side.save([Save("r", "s", store.pool_id, store.generation, 4, [3], [1])])
    side.flush()
    assert side.num_saved_blocks == 0 and side.take_done().failed_saves == {"s": 1}
    side.close()


def test_a_load_named_by_an_older_generation_fails_after_the_store_registered_again(server, store):
    side = worker(server, store, "w", 7)
    old = store.generation
    side.stores.local("n1", old)  # mapped at the old generation
    store._register(old + 10)  # noqa: SLF001 - as the watcher does when the allocator lost the pool
    side.load([Load("r", store.pool_id, "p", old, [1], [2])])
    assert side.take_failed_blocks() == {2}
    side.close()


def test_a_dead_stores_segment_is_swept_by_the_next_store(server, tmp_path):
    from kvservice.blockstore.segment import Descriptor, write_descriptor
    from kvservice.blockstore.store import sweep_dead
    (tmp_path / "kvservice-store-ghost-1").write_bytes(b"\0" * 64)
    write_descriptor(Descriptor("ghost", "kvstore:ghost", str(tmp_path / "kvservice-store-ghost-1"), 2, 32, BS, 1,
                                pid=2 ** 22 + 12345), str(tmp_path))
    assert sweep_dead(str(tmp_path)) == ["ghost"]
    assert not list(tmp_path.glob("kvservice-store-ghost*"))


def test_the_ray_path_checks_the_meta_it_read(server, store):
    """A reader on another node gets the pages and their metadata from the store (`read(..., with_meta)`); a
    slice the store saw rewritten while it read it comes back with its tag cleared."""
    a, pages, _ = sealed_page(server, store)
    data, meta = store.read(pages, "", store.generation, with_meta=True)
    assert data.shape == (3, PAGE) and (meta[:, 0, TAG] != 0).all() and np.array_equal(
        data, store.segment.pages[pages])
    a.close()



def test_each_load_is_timed_part_by_part_and_logged(server, store, caplog):
    """Where a load's time goes (timing.py): the scheduler side's lookup, pin and the unpin sent once the
    workers reported it (commit), the worker's fetch, checks and copy, each added up per tier or path and
    logged at DEBUG, one line per load."""
    a = worker(server, store, "a", 61)
    a_sched = SchedulerSide(settings(server, store, index=False), BS, "a", loads=False, saves=True)
    prompt = list(range(700, 714))
    save_prompt(server, store, a_sched, [a], "r", prompt, [5, 6, 7, 8])
    report(a_sched, a)
    caplog.set_level("DEBUG", logger="kvservice.integrations.vllm.connector")
    b_sched = SchedulerSide(settings(server, store, index=False), BS, "b", loads=True, saves=False)
    b = worker(server, store, "b", 62)
    assert "n1" in b.stores.segments  # its own store, named: mapped at start-up, not by the first load
    b_sched.on_new_request(request("s", prompt))
    assert b_sched.num_new_matched_tokens(request("s", prompt), 0) == (12, False)
    b_sched.after_alloc(request("s", prompt), [1, 2, 3, 4], 12)
    (load,), _ = b_sched.build(scheduled("s", prompt, [1, 2, 3, 4], 12, 2))
    b.load([load])
    report(b_sched, b)
    parts = b.load_parts.snapshot()["local"]
    assert parts["loads"] == 1 and parts["blocks"] == 3 and parts["bytes"] == 3 * PAGE
    assert all(parts[p] > 0 and parts[f"{p}_n"] == 1 for p in ("fetch", "check", "copy")), parts
    assert parts["verify"] == 0 and parts["pin_check"] >= 0  # off for RAM pages; this node's: no RPC
    claims = b_sched.claim_parts.snapshot()["n1"]
    assert all(claims[p] > 0 and claims[f"{p}_n"] == 1 for p in ("lookup", "pin", "commit")), claims
    lines = [r.getMessage() for r in caplog.records]
    assert any("loaded 3 blocks" in m and "over local" in m and "copy" in m for m in lines), lines
    assert any("lookup" in m and "pin on kvstore:n1" in m for m in lines), lines
    assert any("unpin(s) on kvstore:n1" in m for m in lines), lines
    for side in (a, a_sched, b, b_sched):
        side.close()
