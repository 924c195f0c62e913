"""KVServiceConnector's two sides without vLLM (the engine tests run them inside vLLM): the scheduler side
against a real server and store, fed what vLLM's scheduler gives it; the worker sides (one per tensor-parallel
rank) copying pages between KV tensors laid out as vLLM's CPU attention lays them out and a store's segment,
reporting what they did (`Done`) back to the scheduler side, which commits and unpins. The failure paths end in
blocks reported failed (vLLM recomputes them), never in pages read from memory that may have been reused."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvservice.blockstore import BlockStore
from kvservice.blockstore.segment import TAG
from kvservice.integrations.vllm.connector.plan import Load, Save
from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.worker_side import WorkerSide
from tests.service_helpers import start_server

BS = 4
LAYERS, HEADS, HEAD = 2, 2, 3
NUM_BLOCKS = 16
PAGE = LAYERS * HEADS * BS * 2 * HEAD * 4


def kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD, generator=g) for i in range(LAYERS)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server("--hash-block-size", str(BS), log_dir=tmp_path_factory.mktemp("sides"))
    yield proc
    proc.stop()


@pytest.fixture
def store(server, tmp_path):
    s = BlockStore("n1", server.target, 32, PAGE, BS, directory=str(tmp_path))
    yield s
    s.close()


def settings(server, block_store, **kw) -> ConnectorSettings:
    kw.setdefault("store", "n1")
    return ConnectorSettings(address=server.target, shm_dir=block_store.directory, **kw)


def worker(server, block_store, name: str, seed: int, rank: int = 0, world_size: int = 1, **kw) -> WorkerSide:
    side = WorkerSide(settings(server, block_store, **kw), BS, name, rank=rank, world_size=world_size,
                      head_size=HEAD)
    side.register(kv(seed), NUM_BLOCKS)
    return side


def request(req_id: str, prompt: list[int], params: dict | None = None):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, mm_features=[], lora_request=None,
                           cache_salt=None, kv_transfer_params=params)


def scheduled(req_id: str, prompt: list[int], block_ids: list[int], num_computed: int, num_scheduled: int):
    new = SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=(block_ids,),
                          num_computed_tokens=num_computed)
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=idle().scheduled_cached_reqs,
                           num_scheduled_tokens={req_id: num_scheduled})


def idle():
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})


def report(sched: SchedulerSide, *workers: WorkerSide) -> None:
    """What vLLM does after a step: each rank's Done, added up, to the scheduler side; then its teller sends."""
    done = None
    for w in workers:
        w.flush()
        mine = w.take_done()
        if mine is not None:
            done = mine if done is None else done.merge(mine)
    if done is not None:
        sched.workers_done(done)
    sched.teller.flush()


def save_prompt(server, store, sched: SchedulerSide, workers: list[WorkerSide], req_id: str, prompt: list[int],
                block_ids: list[int]):
    sched.on_new_request(request(req_id, prompt))
    _, saves = sched.build(scheduled(req_id, prompt, block_ids, 0, len(prompt)))
    for w in workers:
        w.save(saves)
    return saves


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


def test_a_load_of_pages_never_written_or_of_another_generation_fails(server, store):
    """Pages no save sealed (a pin that was never taken, a page being written) and pages of a store that
    restarted since are not loaded: their blocks are reported failed, so vLLM recomputes them."""
    side = worker(server, store, "w", 3)
    side.load([Load("r", store.pool_id, "no-such-pin", store.generation, [1, 2], [3, 4])])
    assert side.take_failed_blocks() == {3, 4} and side.num_failed_loads == 1
    side.load([Load("r", store.pool_id, "also-none", store.generation + 1, [1], [5])])  # another generation
    assert side.take_failed_blocks() == {5}
    assert side.take_done().loads == {"no-such-pin": 1, "also-none": 1}  # reported all the same: unpinned
    side.close()


def sealed_page(server, store, seed: int = 40) -> tuple[WorkerSide, list[int], Load]:
    """A prompt saved and committed by an engine, and a reader's load of its 3 pages."""
    a = worker(server, store, "a", seed)
    sched = SchedulerSide(settings(server, store, index=False), BS, "a", loads=True, saves=True)
    prompt = list(range(300, 313))
    (save,) = save_prompt(server, store, sched, [a], "r", prompt, [1, 2, 3, 4])
    report(sched, a)
    reader = SchedulerSide(settings(server, store, index=False), BS, "b", loads=True, saves=False)
    reader.on_new_request(request("x", prompt))
    assert reader.num_new_matched_tokens(request("x", prompt), 0) == (12, False)
    reader.after_alloc(request("x", prompt), [5, 6, 7, 8], 12)
    (load,), _ = reader.build(scheduled("x", prompt, [5, 6, 7, 8], 12, 1))
    sched.close()
    reader.close()
    return a, save.store_block_ids, load


def test_a_page_rewritten_while_it_is_read_fails_the_load(server, store):
    a, pages, load = sealed_page(server, store)
    b = worker(server, store, "b", 41)
    seg = b.stores.local("n1", store.generation)
    original = b.mover.submit_load

    def rewritten_meanwhile(job, host, rows, block_ids):
        original(job, host, rows, block_ids)
        seg.meta[rows[1], 0, TAG] = 12345  # another save wrote the page during the copy
    b.mover.submit_load = rewritten_meanwhile
    b.load([load])
    assert b.take_failed_blocks() == {5, 6, 7}
    assert b.counters.totals["failed"] == {"n1|pin_lost": 3}
    a.close()
    b.close()


def test_checksums_catch_a_page_altered_in_memory(server, store):
    """With verify_checksums, a byte flipped in a sealed page (in the shared-memory segment) fails the load;
    without it the tag and format still pass (the knob is what catches it)."""
    a, pages, load = sealed_page(server, store)
    seg = a.stores.local("n1", store.generation)
    seg.pages[pages[1], 100] ^= 0xFF
    checked = worker(server, store, "b", 42, verify_checksums=True)
    checked.load([load])
    assert checked.take_failed_blocks() == {5, 6, 7}
    assert checked.counters.totals["failed"] == {"n1|checksum": 3}
    trusting = worker(server, store, "c", 43)
    trusting.load([load])
    assert not trusting.take_failed_blocks()
    for side in (a, checked, trusting):
        side.close()


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


def test_pages_of_another_size_are_refused(server, tmp_path):
    other = BlockStore("n1", server.target, 8, PAGE + 4, BS, directory=str(tmp_path))
    try:
        side = WorkerSide(ConnectorSettings(address=server.target, store="n1", shm_dir=str(tmp_path)), BS, "w",
                          head_size=HEAD)
        side.register(kv(4), NUM_BLOCKS)
        side.load([Load("r", other.pool_id, "p", other.generation, [1], [2])])
        assert side.take_failed_blocks() == {2}
        side.close()
    finally:
        other.close()


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


def test_store_auto_is_the_nodes_only_live_store(server, store, tmp_path, monkeypatch):
    from kvservice.integrations.vllm.connector.settings import ENV_RAY_NODE
    monkeypatch.delenv(ENV_RAY_NODE, raising=False)
    assert ConnectorSettings.from_extra({"address": "x", "store": "auto", "shm_dir": store.directory}).store == "n1"
    with pytest.raises(ValueError, match="found 0 live stores"):
        ConnectorSettings.from_extra({"address": "x", "store": "auto", "shm_dir": str(tmp_path / "none")})
    # A vLLM subprocess of a Ray actor: the actor's node, handed down.
    monkeypatch.setenv(ENV_RAY_NODE, "0123456789abcdef")
    assert ConnectorSettings.from_extra({"address": "x", "store": "auto", "shm_dir": str(tmp_path / "none")}).store \
        == "node-0123456789ab"


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


def quantised_kv(seed: int, heads: int, content: int, dtype=torch.uint8) -> dict[str, torch.Tensor]:
    """CUDA-style LBHNC views (contiguous per layer) of an fp8 (uint8) or bf16 cache, on CPU tensors."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return {f"model.layers.{i}.attn": torch.randint(0, 255, (NUM_BLOCKS, heads, BS, content), generator=g,
                                                        dtype=torch.uint8) for i in range(LAYERS)}
    return {f"model.layers.{i}.attn": torch.randn(NUM_BLOCKS, heads, BS, content, generator=g).to(dtype)
            for i in range(LAYERS)}


def test_fp8_and_mla_pages_load_only_into_an_engine_with_their_dtype_scales_and_shape(server, tmp_path):
    """An fp8 engine's pages (uint8, scales 0.5/0.25) load into an fp8 engine with those scales, and never into
    one with other scales, a bf16 cache or an MLA shape of the same page size: the per-page format digest fails
    those loads (recomputed), whatever the namespace let through."""
    fp8 = 2 * HEAD  # C of K and V, one byte each
    page = LAYERS * HEADS * BS * fp8
    store = BlockStore("q", server.target, 32, page, BS, directory=str(tmp_path))
    try:
        def engine(name, kv_caches, cache_dtype, scales):
            w = WorkerSide(settings(server, store, store="q"), BS, name, head_size=HEAD, cache_dtype=cache_dtype,
                           cpu_attention=False)
            w.register(kv_caches, NUM_BLOCKS, scales)
            return w

        scales = {f"model.layers.{i}.attn": (0.5, 0.25) for i in range(LAYERS)}
        written, same_kv = quantised_kv(1, HEADS, fp8), quantised_kv(2, HEADS, fp8)
        writer = engine("w", written, "fp8", scales)
        sched = SchedulerSide(settings(server, store, store="q", index=False), BS, "w", loads=True, saves=True)
        prompt = list(range(800, 813))
        sched.on_new_request(request("r", prompt))
        _, saves = sched.build(scheduled("r", prompt, [1, 2, 3, 4], 0, len(prompt)))
        writer.save(saves)
        report(sched, writer)
        reader_sched = SchedulerSide(settings(server, store, store="q", index=False), BS, "x", loads=True,
                                     saves=False)
        reader_sched.on_new_request(request("x", prompt))
        assert reader_sched.num_new_matched_tokens(request("x", prompt), 0) == (12, False)
        reader_sched.after_alloc(request("x", prompt), [5, 6, 7, 8], 12)
        (load,), _ = reader_sched.build(scheduled("x", prompt, [5, 6, 7, 8], 12, 1))
        other_scales = {k: (1.0, 1.0) for k in scales}
        readers = {
            "same": engine("a", same_kv, "fp8", scales),
            "other scales": engine("b", quantised_kv(3, HEADS, fp8), "fp8", other_scales),
            "e5m2": engine("c", quantised_kv(4, HEADS, fp8), "fp8_e5m2", scales),
            "bf16, half the heads": engine("d", quantised_kv(5, HEADS // 2, fp8, torch.bfloat16), "auto", None),
            "MLA-shaped": engine("e", quantised_kv(6, 1, HEADS * fp8), "fp8", scales),
        }
        failed = {}
        for what, r in readers.items():
            assert r.page_bytes == page, what  # the same page size: only the format tells them apart
            r.load([load])
            failed[what] = sorted(r.take_failed_blocks())
        assert failed == {"same": [], "other scales": [5, 6, 7], "e5m2": [5, 6, 7], "bf16, half the heads": [5, 6, 7],
                          "MLA-shaped": [5, 6, 7]}, failed
        for name in written:
            assert torch.equal(same_kv[name][[5, 6, 7]], written[name][[1, 2, 3]])
        for side in (writer, sched, reader_sched, *readers.values()):
            side.close()
    finally:
        store.close()


def test_a_page_holding_another_prefix_fails_the_load(server, store):
    """Tags name each page's block (its chained hash): a load naming a page that holds another prompt's block,
    as after a pin lost with its session or an index that lost track, fails instead of loading that KV."""
    a, pages, load = sealed_page(server, store)
    other = SchedulerSide(settings(server, store, index=False), BS, "o", loads=True, saves=False)
    elsewhere = list(range(900, 913))
    other.on_new_request(request("q", elsewhere))
    wrong = Load("q", load.pool_id, load.pin_id, load.generation, load.store_block_ids, [9, 10, 11],
                 tags=other.tags(other.tracked["q"])[:3])
    b = worker(server, store, "b", 46)
    b.load([wrong])
    assert b.take_failed_blocks() == {9, 10, 11} and b.counters.totals["failed"] == {"n1|pin_lost": 3}
    b.load([load])  # the right prompt's tags: loads
    assert not b.take_failed_blocks()
    for side in (a, b, other):
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
