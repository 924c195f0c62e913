"""The checks a worker makes before it trusts a store's page: written and sealed (its tag), the block the load
names (its chained hash), unchanged while it was read, its checksum (verify_checksums), and this engine's page
format (size, dtype, scales, shape). Any doubt fails the load's blocks: vLLM recomputes them; a checksum fails
only from its page on."""

# ruff: noqa: F811 - the fixtures `server` and `store` come from connector_helpers

from __future__ import annotations

import torch

from kvservice.blockstore import BlockStore
from kvservice.blockstore.segment import TAG
from kvservice.integrations.vllm.connector.plan import Load
from kvservice.integrations.vllm.connector.scheduler_side import SchedulerSide
from kvservice.integrations.vllm.connector.settings import ConnectorSettings
from kvservice.integrations.vllm.connector.worker_side import WorkerSide
from tests.connector_helpers import (  # noqa: F401 - server, store: the module's fixtures
    BS,
    HEAD,
    HEADS,
    LAYERS,
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
    """With verify_checksums, a byte flipped in a sealed page (in the shared-memory segment) fails that block
    and the ones after it (vLLM's computed tokens are a prefix), the block before it loads; without it the tag
    and format still pass (the knob is what catches it)."""
    a, pages, load = sealed_page(server, store)
    seg = a.stores.local("n1", store.generation)
    seg.pages[pages[1], 100] ^= 0xFF
    checked = worker(server, store, "b", 42, verify_checksums=True)
    checked.load([load])
    assert checked.take_failed_blocks() == {6, 7}
    assert checked.counters.totals["failed"] == {"n1|checksum": 2}
    assert checked.counters.totals["loaded"] == {"n1": 1}
    trusting = worker(server, store, "c", 43)
    trusting.load([load])
    assert not trusting.take_failed_blocks()
    for side in (a, checked, trusting):
        side.close()


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


def test_a_corrupted_page_fails_only_from_its_block_on_and_every_bad_page_leaves_the_index(server, store):
    """Eight pages, bits flipped in the 6th and the 8th: the first five load (equal to the writer's blocks), the
    last three are reported failed (what vLLM recomputes: its computed tokens stop at the first bad block),
    both bad pages are counted and dropped from the index, the good ones stay."""
    writer_kv, reader_kv = kv(50, 24), kv(51, 24)
    a = WorkerSide(settings(server, store), BS, "a", head_size=HEAD)
    a.register(writer_kv, 24)
    sched = SchedulerSide(settings(server, store, index=False), BS, "a", loads=True, saves=True)
    prompt = list(range(500, 533))  # 8 whole blocks
    (save,) = save_prompt(server, store, sched, [a], "r", prompt, list(range(1, 10)))
    report(sched, a)
    seg = a.stores.local("n1", store.generation)
    for i in (5, 7):
        seg.pages[save.store_block_ids[i], 7] ^= 0x01
    reader = SchedulerSide(settings(server, store, index=False), BS, "b", loads=True, saves=False)
    reader.on_new_request(request("x", prompt))
    assert reader.num_new_matched_tokens(request("x", prompt), 0) == (32, False)
    reader.after_alloc(request("x", prompt), list(range(10, 19)), 32)
    (load,), _ = reader.build(scheduled("x", prompt, list(range(10, 19)), 32, 1))
    b = WorkerSide(settings(server, store, verify_checksums=True), BS, "b", head_size=HEAD)
    b.register(reader_kv, 24)
    b.load([load])
    assert b.take_failed_blocks() == {15, 16, 17}
    totals = b.counters.totals
    assert (totals["loaded"], totals["failed"], totals["checksum_failures"]) == \
        ({"n1": 5}, {"n1|checksum": 3}, {"ram": 2})
    for name in writer_kv:
        assert torch.equal(reader_kv[name][10:15], writer_kv[name][1:6])
    report(reader, b)
    with server.client(client_name="probe", hash_block_size=BS) as c:
        assert c.lookup(prompt, pool_ids=[store.pool_id]).tokens(store.pool_id) == 20  # 5 blocks: the 6th is gone
    for side in (a, b, sched, reader):
        side.close()
