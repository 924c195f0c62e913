"""KVServiceConnector's two sides without vLLM (the engine tests run them inside vLLM): the scheduler side
against a real server and store, fed what vLLM's scheduler gives it; the worker side copying pages between
KV tensors laid out as vLLM's CPU attention lays them out and a store's segment. The failure paths end in
blocks reported failed (vLLM recomputes them), never in pages read from memory that may have been reused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvservice.blockstore import BlockStore
from kvservice.integrations.vllm.connector.plan import Load
from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.worker_side import PageLayout, WorkerSide, runs
from tests.service_helpers import start_server

BS = 4
LAYERS, HEADS, HEAD = 2, 2, 3
NUM_BLOCKS = 16


def kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD, generator=g) for i in range(LAYERS)}


PAGE = LAYERS * HEADS * BS * 2 * HEAD * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server("--hash-block-size", str(BS), log_dir=tmp_path_factory.mktemp("sides"))
    yield proc
    proc.stop()


@pytest.fixture
def store(server, tmp_path, request):
    s = BlockStore("n1", server.target, 32, PAGE, BS, directory=str(tmp_path))
    yield s
    s.close()


def settings(server, store, **kw) -> ConnectorSettings:
    return ConnectorSettings(address=server.target, store="n1", shm_dir=store.directory, **kw)


def request(req_id: str, prompt: list[int]):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, mm_features=[], lora_request=None,
                           cache_salt=None)


def scheduled(req_id: str, prompt: list[int], block_ids: list[int], num_computed: int, num_scheduled: int):
    new = SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=(block_ids,),
                          num_computed_tokens=num_computed)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req_id: num_scheduled})


def test_runs_coalesce_ids_counting_up_together():
    assert runs([3, 4, 5, 9, 10], [7, 8, 2, 3, 4]) == [(0, 2), (2, 1), (3, 2)]
    assert runs([], []) == []


def test_pages_round_trip_between_engines_through_the_store(server, store):
    """Engine A saves a prompt; engine B (other KV memory, other block ids) loads it: B's blocks hold A's bytes,
    and B's other blocks are untouched."""
    a_kv, b_kv = kv(1), kv(2)
    a = WorkerSide(settings(server, store), BS, "a")
    a.register(a_kv, NUM_BLOCKS)
    assert a.layout.page_bytes == PAGE
    a_sched = SchedulerSide(settings(server, store), BS, "a", loads=True, saves=True)
    prompt = list(range(1, 15))  # 3 whole blocks + 2
    a_sched.on_new_request(request("r", prompt))
    loads, saves = a_sched.build(scheduled("r", prompt, [5, 6, 7, 8], 0, len(prompt)))
    assert not loads and len(saves) == 1 and saves[0].local_block_ids == [5, 6, 7]
    a.save(saves)
    a.flush()
    b_sched = SchedulerSide(settings(server, store), BS, "b", loads=True, saves=True)
    mine = prompt[:12] + [99, 98, 97]
    b_sched.on_new_request(request("s", mine))
    assert b_sched.num_new_matched_tokens(request("s", mine), 0) == 12
    assert b_sched.num_new_matched_tokens(request("s", mine), 0) == 12  # asked again: the same pin
    assert b_sched.num_pins == 1
    b_sched.after_alloc(request("s", mine), [9, 2, 11, 4], 12)
    (load,), saves = b_sched.build(scheduled("s", mine, [9, 2, 11, 4], 12, 3))
    assert load.local_block_ids == [9, 2, 11] and not saves  # every whole block was loaded: not saved again
    b = WorkerSide(settings(server, store), BS, "b")
    b.register(b_kv, NUM_BLOCKS)
    before = {name: t.clone() for name, t in b_kv.items()}
    b.load([load])
    assert not b.take_failed_blocks()
    for name in a_kv:
        assert torch.equal(b_kv[name][[9, 2, 11]], a_kv[name][[5, 6, 7]])
        untouched = [i for i in range(NUM_BLOCKS) if i not in (9, 2, 11)]
        assert torch.equal(b_kv[name][untouched], before[name][untouched])
    for side in (a, b, a_sched, b_sched):
        side.close()


def test_a_load_whose_pin_is_gone_is_reported_failed(server, store):
    """Pages of a pin that was released (a lapsed lease, a restarted store) may have been reused while they
    were copied: their blocks are reported failed, so vLLM recomputes them."""
    side = WorkerSide(settings(server, store), BS, "w")
    side.register(kv(3), NUM_BLOCKS)
    side.load([Load("r", store.pool_id, "no-such-pin", store.generation, [1, 2], [3, 4])])
    assert side.take_failed_blocks() == {3, 4} and side.num_failed_loads == 1
    side.load([Load("r", store.pool_id, "also-none", store.generation + 1, [1], [5])])  # another generation
    assert side.take_failed_blocks() == {5}
    side.close()


def test_pages_of_another_size_are_refused(server, tmp_path):
    other = BlockStore("n1", server.target, 8, PAGE + 4, BS, directory=str(tmp_path))
    try:
        side = WorkerSide(ConnectorSettings(address=server.target, store="n1", shm_dir=str(tmp_path)), BS, "w")
        side.register(kv(4), NUM_BLOCKS)
        side.load([Load("r", other.pool_id, "p", other.generation, [1], [2])])
        assert side.take_failed_blocks() == {2}
        side.close()
    finally:
        other.close()


def test_without_the_allocator_nothing_is_found_and_sharing_pauses(tmp_path):
    side = SchedulerSide(ConnectorSettings(address="127.0.0.1:1", store="n1", timeout_s=0.2, retry_after_s=30),
                         BS, "x", loads=True, saves=True)
    prompt = list(range(1, 30))
    side.on_new_request(request("r", prompt))
    assert side.num_new_matched_tokens(request("r", prompt), 0) == 0
    assert side.num_failures == 1 and not side.available()
    side.on_new_request(request("q", prompt))
    assert side.num_new_matched_tokens(request("q", prompt), 0) == 0 and side.num_failures == 1  # not asked again
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
    with pytest.raises(ValueError, match="blocks on dim 0"):
        PageLayout({"l0": torch.zeros(2, NUM_BLOCKS, 4)}, NUM_BLOCKS)


def test_store_auto_is_the_nodes_only_live_store(server, store, tmp_path):
    assert ConnectorSettings.from_extra({"address": "x", "store": "auto", "shm_dir": store.directory}).store == "n1"
    with pytest.raises(ValueError, match="found 0 live stores"):
        ConnectorSettings.from_extra({"address": "x", "store": "auto", "shm_dir": str(tmp_path / "none")})


def test_a_hit_asked_again_answers_and_loads_from_the_engines_new_hit(server, store):
    """vLLM asks again when it could not admit the request; the engine's own hit may have shrunk meanwhile:
    the answer and the load follow the last ask (every block past the engine's hit is loaded)."""
    a = WorkerSide(settings(server, store), BS, "a")
    a.register(kv(5), NUM_BLOCKS)
    writer = SchedulerSide(settings(server, store, index=False), BS, "a", loads=True, saves=True)
    prompt = list(range(40, 57))  # 4 whole blocks + 1
    writer.on_new_request(request("w", prompt))
    _, saves = writer.build(scheduled("w", prompt, [1, 2, 3, 4, 5], 0, len(prompt)))
    a.save(saves)
    a.flush()
    reader = SchedulerSide(settings(server, store, index=False), BS, "b", loads=True, saves=False)
    reader.on_new_request(request("r", prompt))
    assert reader.num_new_matched_tokens(request("r", prompt), 8) == 8  # the engine had 2 blocks
    assert reader.num_new_matched_tokens(request("r", prompt), 0) == 16  # ...then none (evicted)
    reader.after_alloc(request("r", prompt), [6, 7, 8, 9, 10], 16)
    (load,), _ = reader.build(scheduled("r", prompt, [6, 7, 8, 9, 10], 16, 1))
    assert load.local_block_ids == [6, 7, 8, 9] and len(load.store_block_ids) == 4
    for side in (a, writer, reader):
        side.close()


def test_no_save_copies_the_blocks_of_a_request_whose_load_failed(server, store):
    """The load fails in one step; the prompt completes in a later one (async scheduling schedules it before
    vLLM hears of the failure): its save is dropped, so no store page gets the failed blocks."""
    from kvservice.integrations.vllm.connector.plan import Save
    side = WorkerSide(settings(server, store), BS, "w")
    side.register(kv(6), NUM_BLOCKS)
    side.load([Load("r", store.pool_id, "gone", store.generation, [1], [3])])
    assert side.take_failed_blocks() == {3}
    side.save([Save("r", "s", store.pool_id, store.generation, 4, [3], [1])])
    assert side.num_saved_blocks == 0
    side.close()


def test_a_load_named_by_an_older_generation_fails_after_the_store_registered_again(server, store):
    side = WorkerSide(settings(server, store), BS, "w")
    side.register(kv(7), NUM_BLOCKS)
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
