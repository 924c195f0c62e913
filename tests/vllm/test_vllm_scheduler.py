"""vLLM 0.33.0's own schedulers allocating from a real `kvservice serve` (kvservice.integrations.vllm.Scheduler
and AsyncScheduler): step-for-step the same SchedulerOutputs as the stock schedulers on random workloads in
vLLM's default configuration, with async scheduling and the full-sequence gate each off, and with a
sliding-window group (the smaller version of bench/vllm_scheduler_parity.py); at most one Step RPC per
scheduler step, and in steady decode only the calls that change blocks; vLLM's own KV events;
`scheduler_cls` resolves them; unsupported settings refused at start-up; a pool changed behind the
scheduler's back is caught (pipelined: by the next schedule()), and the pipeline setting.

Runs in the project's vLLM environment only (make vllm-env):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        ~/.cache/kvservice/vllm-0.33.0/venv/bin/python -m pytest -q tests/vllm/test_vllm_scheduler.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM 0.33.0 environment (make vllm-env; see this file's docstring)")

from vllm.config import KVEventsConfig, KVTransferConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402

from kvservice.integrations.vllm import AsyncScheduler, Scheduler  # noqa: E402
from kvservice.integrations.vllm.config import UnsupportedConfig  # noqa: E402
from kvservice.integrations.vllm.remote import PoolDiverged  # noqa: E402
from kvservice.integrations.vllm.version import VLLM  # noqa: E402
from kvservice.ops import AddRequestOp, AllocateOp  # noqa: E402
from tests.service_helpers import start_server  # noqa: E402
from tests.vllm import scheduler_harness as h  # noqa: E402

NUM_WORKLOADS = 24  # per mode; the bench runs >= 200
# An EAGLE group without EAGLE's block drop (the harness has no drafter) exists only in vLLM 0.33: 0.32 flags a
# group as EAGLE's only for a drafter that drops blocks, and then drops them from every EAGLE group.
needs_eagle_groups = pytest.mark.skipif(VLLM.minor < (0, 33), reason=f"vLLM {VLLM.version} has no EAGLE group "
                                                                     f"without EAGLE's block drop")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server(log_dir=tmp_path_factory.mktemp("vllm-sched"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def sub_block_server(tmp_path_factory):
    """An allocator hashing half-blocks: a hybrid model's prefix-match unit below its block size."""
    proc = start_server("--hash-block-size", str(h.BLOCK // 2), log_dir=tmp_path_factory.mktemp("vllm-sub"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def dcp_server(tmp_path_factory):
    """An allocator hashing two-rank DCP blocks (the scheduler's block size: BLOCK tokens per rank, 2 ranks)."""
    proc = start_server("--hash-block-size", str(2 * h.BLOCK), log_dir=tmp_path_factory.mktemp("vllm-dcp"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return h.write_model_dir(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize("mode", h.MODES, ids=lambda m: m.name.replace(", ", "-").replace(" ", "_"))
def test_schedules_equal_the_stock_scheduler(server, model_dir, mode):
    config = h.make_vllm_config(model_dir, mode)
    totals = h.Outcome()
    for seed in range(NUM_WORKLOADS):
        workload = h.Workload.random(seed, num_steps=100)
        out = h.run_pair(workload, mode, config, server.target, f"parity-{mode.async_scheduling:d}"
                                                                 f"{mode.full_sequence_gate:d}-{seed}")
        assert out.rpcs <= out.steps  # one Step per scheduler step at most (none when nothing changed)
        totals.add(out)
    # The workloads exercise what the parity claims: preemption, prefix hits, chunked prefill, n > 1.
    assert totals.preemptions > 10 and totals.hits > 50 and totals.chunked > 20 and totals.n_gt_1 > 20, totals


@pytest.mark.parametrize("mode", [h.DEFAULT, h.Mode(async_scheduling=False)], ids=["async", "sync"])
def test_steps_coalesced_within_step_interval_ms(server, model_dir, mode):
    """step_interval_ms: steps within it of the last Step send none, their ops going with a later Step; the
    schedules stay the stock scheduler's, and the pool equals the replica at every check (check_pool sends
    what waits, every 10 steps)."""
    config = h.make_vllm_config(model_dir, mode)
    totals = h.run_seeds(mode, config, server.target, f"coalesced-{mode.async_scheduling:d}", 6,
                         {"step_interval_ms": 60_000})
    assert totals.steps > 300 and totals.rpcs <= totals.steps // 5, totals


@pytest.mark.parametrize("interval_ms, retention", [(0, None), (60_000, None), (0, 0)],
                         ids=["every-step", "coalesced", "sparse-retention"])
def test_a_hybrid_mamba_model_schedules_as_stock_however_steps_fall_into_rpcs(server, model_dir, interval_ms,
                                                                             retention):
    """Full attention + Mamba ("align"): a state cached in a step is no hit until the next one. With steps
    coalesced into one Step the pool still hears where each scheduler step starts (NewStepOp), so the
    schedules stay the stock scheduler's and the pool the replica's. With vLLM's default sparse retention
    (prefix_cache_retention_interval 0) a hit's shared-prefix boundary decides which states are cached: the
    pool hears it with the admission."""
    mode = h.Mode(mamba=True, retention=retention)
    config = h.make_vllm_config(model_dir, mode)
    totals = h.run_seeds(mode, config, server.target, f"mamba-{interval_ms}-{retention}", 4,
                         {"step_interval_ms": interval_ms})
    assert totals.hits > 20 and totals.rpcs <= (totals.steps if interval_ms == 0 else totals.steps // 3), totals


@pytest.mark.parametrize("mode", [h.Mode(mamba=True, mamba_checkpoints=True),
                                  h.Mode(async_scheduling=False, mamba=True, mamba_checkpoints=True, spec_tokens=3)],
                         ids=["checkpoints-async", "checkpoints-speculative-sync"])
def test_mamba_prefill_checkpoints_and_speculative_blocks_schedule_as_stock(server, model_dir, mode):
    """vLLM's Mamba2 layers in "align" mode: a checkpoint block a prefill chunk exports an interior state into
    and, under speculative decoding, a scratch block per draft token, relocated as drafts are accepted."""
    config = h.make_vllm_config(model_dir, mode)
    totals = h.run_seeds(mode, config, server.target, f"mamba-ckpt-{mode.spec_tokens}", 4)
    assert totals.hits > 20 and totals.rpcs <= totals.steps, totals


@pytest.mark.parametrize("mode", [h.Mode(mamba=True, hash_block=h.BLOCK // 2),
                                  h.Mode(async_scheduling=False, mamba=True, mamba_checkpoints=True, spec_tokens=3,
                                         hash_block=h.BLOCK // 2),
                                  pytest.param(h.Mode(mamba=True, hash_block=h.BLOCK // 2, retention=0,
                                                      eagle_group=True, shared_prefix_checkpoint=True),
                                               marks=needs_eagle_groups)],
                         ids=["async", "checkpoints-speculative-sync", "eagle-shared-prefix-checkpoints"])
def test_sub_block_prefix_hits_and_their_copies_schedule_as_stock(sub_block_server, model_dir, mode):
    """vLLM's hash_block_size below the block size (a hybrid Mamba model's prefix-match unit): a hit may end
    inside a block, whose shared tail the manager redirects to a private copy. The scheduler takes the step's
    copies and frees both ends once the step that copies is processed; the pool holds them as long."""
    config = h.make_vllm_config(model_dir, mode)
    totals = h.run_seeds(mode, config, sub_block_server.target, f"sub-block-{mode.name}", 4)
    assert totals.copies > 20 and totals.rpcs <= totals.steps, totals


@pytest.mark.parametrize("mode", [h.Mode(dcp=2), h.Mode(async_scheduling=False, dcp=2, spec_tokens=3),
                                  h.Mode(dcp=2, connector="async"), h.Mode(async_scheduling=False, dcp=2, pcp=2)]
                         + [h.Mode(dcp=2, mamba=True)],
                         ids=lambda m: m.name.replace(", ", "-").replace(" ", "_"))
def test_context_parallel_schedules_as_stock(dcp_server, model_dir, mode):
    """Decode context parallelism: attention blocks sharded across 2 ranks (each spans 2 * BLOCK tokens), a
    Mamba group replicated beside them; prefill context parallelism, which vLLM's scheduler keeps out of its
    KV-cache manager (pcp_world_size 1), as this one does."""
    config = h.make_vllm_config(model_dir, mode)
    totals = h.run_seeds(mode, config, dcp_server.target, f"cp-{mode.name}", 3)
    assert totals.hits > 10 and totals.rpcs <= totals.steps, totals


def test_blocks_a_connector_pins_through_the_block_pool_are_held_in_the_pool(server, model_dir):
    """KV connectors that offload (vLLM's simple CPU offload, Mooncake's store) pin blocks with the block pool's
    touch and free them through it once stored; blocks may be taken from it too. The pool holds what the
    replica holds, and the schedules go on from the same free blocks."""
    config = h.make_vllm_config(model_dir, h.Mode(async_scheduling=False))
    workload = h.Workload(seed=3, num_blocks=24, max_num_batched_tokens=2048, max_num_seqs=16, watermark=0.0,
                          num_steps=0)
    config.cache_config.num_gpu_blocks = workload.num_blocks
    config.additional_config = {"kvservice": {"address": server.target, "pool_id": "touched"}}
    side = h.Side(Scheduler, config, workload)
    pool = side.scheduler.kv_cache_manager.block_pool
    side.add("a", list(range(3, 60)), 1)
    while side.scheduler.requests:
        side.schedule()
        side.update()
    cached = [b for b in pool.blocks[1:] if b.block_hash is not None]
    assert cached
    pool.touch(cached)  # a connector storing a's blocks: pinned until stored
    taken = pool.get_new_blocks(2)
    h.check_pool(side.scheduler, "pinned")
    side.add("b", list(range(3, 60)) + [7] * 40, 1)  # a's prefix still hits: pinned blocks stay cached
    side.schedule()
    assert side.scheduler.kv_cache_manager.get_block_ids("b")[0][:len(cached)] == [b.block_id for b in cached]
    side.update()
    pool.free_blocks(cached + taken)
    h.check_pool(side.scheduler, "stored")
    side.scheduler.shutdown()


def test_the_pool_follows_this_vllms_mamba_manager(server, model_dir, monkeypatch):
    """vLLM 0.32's MambaManager caches a prompt tail again where it is already keyed, 0.33's does not: the
    scheduler registers its pool saying which (the hybrid parity tests above hold under either version, and
    fail under 0.32 without it)."""
    from kvservice.client import KVServiceClient

    registered = []
    original = KVServiceClient.register_pool

    def register_pool(self, pool_id, *args, **kwargs):
        registered.append(kwargs.get("vllm"))
        return original(self, pool_id, *args, **kwargs)

    monkeypatch.setattr(KVServiceClient, "register_pool", register_pool)
    for mode in (h.Mode(mamba=True), h.DEFAULT):
        config = h.make_vllm_config(model_dir, mode)
        workload = h.Workload.random(0)
        config.cache_config.num_gpu_blocks = workload.num_blocks
        config.additional_config = {"kvservice": {"address": server.target, "pool_id": f"version-{mode.mamba}"}}
        h.Side(AsyncScheduler, config, workload, mode).scheduler.shutdown()
    assert [o.mamba_recache_keyed_tails for o in registered] == [VLLM.minor < (0, 33), False], registered


@pytest.mark.parametrize("mode", [h.Mode(extra="rswa"), h.Mode(async_scheduling=False, extra="rswa"),
                                  h.Mode(extra="ring"), h.Mode(async_scheduling=False, extra="ring")],
                         ids=["rswa-async", "rswa-sync", "ring-async", "ring-sync"])
def test_rswa_and_circular_buffer_groups_schedule_as_stock(server, model_dir, mode):
    """A second group beside full attention: R-SWA (window 4: a decode frees the gap between the prompt
    and the window each step) or a circular buffer (one block a request, never cached); the pool frees
    and holds what the replica does."""
    config = h.make_vllm_config(model_dir, mode)
    totals = h.run_seeds(mode, config, server.target, f"{mode.extra}-{mode.async_scheduling:d}", 4)
    assert totals.steps > 200 and totals.rpcs <= totals.steps, totals


def test_scheduler_cls_resolves_and_registers_the_pool(server, model_dir):
    config = h.make_vllm_config(model_dir, h.DEFAULT)
    for path, cls in (("kvservice.integrations.vllm.AsyncScheduler", AsyncScheduler),
                      ("kvservice.integrations.vllm.Scheduler", Scheduler)):
        config.scheduler_config.scheduler_cls = path
        assert config.scheduler_config.get_scheduler_cls() is cls
    config.scheduler_config.scheduler_cls = None
    workload = h.Workload.random(0)
    config.cache_config.num_gpu_blocks = workload.num_blocks
    config.additional_config = {"kvservice": {"address": server.target, "pool_id": "cls-pool"}}
    first = h.Side(AsyncScheduler, config, workload).scheduler
    second = h.Side(AsyncScheduler, config, workload).scheduler  # an engine restart: a new epoch
    assert (first.kvservice_epoch, second.kvservice_epoch) == (0, 1)
    client = second.kvservice_client
    pool = client.get_stats().pools["cls-pool"]
    assert pool.epoch == 1 and pool.num_blocks == workload.num_blocks
    first.shutdown()
    second.shutdown()


def _capture_events(side: h.Side) -> list:
    events = []
    side.scheduler.kv_event_publisher.publish = lambda batch: events.extend(batch.events)
    return events


def test_take_events_are_vllms_own_and_equal_the_stock_ones(server, model_dir):
    config = h.make_vllm_config(model_dir, h.DEFAULT)
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    workload = h.Workload.random(3, num_steps=80)
    config.cache_config.num_gpu_blocks = workload.num_blocks
    config.additional_config = {"kvservice": {"address": server.target, "pool_id": "events-pool"}}
    stock, remote = (h.Side(h.StockAsyncScheduler, config, workload), h.Side(AsyncScheduler, config, workload))
    stock_events, remote_events = _capture_events(stock), _capture_events(remote)
    for step in range(workload.num_steps):
        for args in workload.arrivals.get(step, ()):
            stock.add(*args)
            remote.add(*args)
        assert stock.schedule() == remote.schedule()
        while len(stock.pending) >= 2:
            stock.update()
            remote.update()
    assert remote_events == stock_events
    kinds = {type(e) for e in remote_events}
    assert BlockStored in kinds and BlockRemoved in kinds, kinds
    remote.scheduler.shutdown()


def test_unsupported_settings_are_refused_at_start_up(server, model_dir, tmp_path):
    config = h.make_vllm_config(model_dir, h.DEFAULT)
    workload = h.Workload.random(0)
    config.cache_config.num_gpu_blocks = workload.num_blocks
    config.additional_config = {"kvservice": {"address": server.target, "pool_id": "refused"}}
    spec = h.FullAttentionSpec(block_size=h.BLOCK, num_kv_heads=1, head_size=1, dtype=h.torch.float32)
    kv = h.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[h.KVCacheGroupSpec(["layer"], spec)])
    # A KV connector is accepted now: the scheduler starts, registers its pool and binds the connector to it.
    config.kv_transfer_config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                                 kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    config.scheduler_config.disable_hybrid_kv_cache_manager = True  # what ExampleConnector needs
    config.additional_config = {"kvservice": {"address": server.target, "pool_id": "with-connector"}}
    scheduler = AsyncScheduler(vllm_config=config, kv_cache_config=kv, block_size=h.BLOCK,
                               structured_output_manager=h.StructuredOutputManager(config))
    assert scheduler.connector._kv_cache_manager is scheduler.kv_cache_manager
    assert "with-connector" in server.client().get_stats().pools
    scheduler.shutdown()
    config.kv_transfer_config, config.scheduler_config.disable_hybrid_kv_cache_manager = None, None
    config.additional_config = {"kvservice": {"address": server.target, "pool": "x"}}
    with pytest.raises(UnsupportedConfig, match=r"unknown keys \['pool'\]"):
        AsyncScheduler(vllm_config=config, kv_cache_config=kv, block_size=h.BLOCK,
                       structured_output_manager=h.StructuredOutputManager(config))
    assert "refused" not in server.client().get_stats().pools


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "unpipelined"])
def test_a_pool_changed_behind_the_schedulers_back_is_caught(server, model_dir, pipeline):
    """Unpipelined, the step that diverges raises; pipelined, the step after it does, before its output leaves
    (and every later step raises too)."""
    config = h.make_vllm_config(model_dir, h.Mode(async_scheduling=False))
    workload = h.Workload(seed=9, num_blocks=40, max_num_batched_tokens=2048, max_num_seqs=16, watermark=0.0,
                          num_steps=4)
    config.cache_config.num_gpu_blocks = workload.num_blocks
    pool_id = f"shared-{pipeline}"
    config.additional_config = {"kvservice": {"address": server.target, "pool_id": pool_id, "pipeline": pipeline}}
    side = h.Side(Scheduler, config, workload)
    side.add("a", list(range(3, 40)), 8)
    side.schedule()
    side.update()
    intruder = server.client(hash_block_size=h.BLOCK)
    hashes = [bytes(32)] * 2
    intruder.step(pool_id, [AddRequestOp("x", block_hashes=hashes, num_tokens=32), AllocateOp("x", num_new_tokens=32)])
    side.add("b", list(range(100, 140)), 8)
    if pipeline:
        side.schedule()  # b's blocks: sent, checked in the background
        side.update()
    with pytest.raises(PoolDiverged, match=f"pool '{pool_id}'"):
        side.schedule()
    with pytest.raises(PoolDiverged, match="an earlier Step failed"):
        side.scheduler.kv_cache_manager.flush()
    side.scheduler.kvservice_client.close()


def test_folding_keeps_every_allocation_in_the_schedulers_order():
    """A running request's allocation joins its cache row of the step only when no allocation or free lies
    after that cache row: scheduled in the cache rows' order, all three fold; in reverse order only the last
    request's does (an earlier fold would move its allocation before the ones the scheduler made first)."""
    from types import SimpleNamespace

    from kvservice.integrations.vllm.remote import RemoteKVCacheManager
    from kvservice.ops import ROW_WIDTH, AllocateBatchOp

    def record(order: list[str]) -> list:
        m = object.__new__(RemoteKVCacheManager)  # the recording half only: no replica, no pool
        m._ops, m._expected, m._rows, m._cache_rows, m._position, m._last_barrier = [], [], None, {}, 0, 0
        reqs = {rid: SimpleNamespace(request_id=rid, num_computed_tokens=8, num_output_placeholders=0,
                                     num_in_flight_tokens=0) for rid in "abc"}
        no_blocks = m.empty_kv_cache_blocks = SimpleNamespace(blocks=([],))
        for rid in order:  # "c:x" a cache_blocks call, "x" an allocation
            if rid.startswith("c:"):
                m._cache_row(reqs[rid[2:]], [], 0, 0, 8)
            else:
                m._allocation_row(reqs[rid], [], 0, 1, 0, 0, 0, no_blocks)
        [batch] = m._ops
        assert isinstance(batch, AllocateBatchOp)
        r = batch.rows
        return [(rid, r[ROW_WIDTH * j + 7], r[ROW_WIDTH * j + 1]) for j, rid in enumerate(batch.request_ids)]

    caches = ["c:a", "c:b", "c:c"]
    assert record(caches + ["a", "b", "c"]) == [("a", 8, 1), ("b", 8, 1), ("c", 8, 1)]
    assert record(caches + ["c", "b", "a"]) == [("a", 8, 0), ("b", 8, 0), ("c", 8, 1), ("b", 0, 1), ("a", 0, 1)]
    # A request's second cache call: the allocation joins the latest one, the first stays a row of its own.
    assert record(["c:a", "c:b", "c:a", "a", "b"]) == [("a", 8, 0), ("b", 8, 0), ("a", 8, 1), ("b", 0, 1)]


def test_steady_decode_sends_only_the_calls_that_change_blocks(server, model_dir):
    """16 decoding requests of staggered lengths: each step one of them fills a block, and only its calls
    travel (a row or two per Step, not 32); the pool still equals the replica, block for block."""
    from kvservice.ops import AllocateBatchOp

    config = h.make_vllm_config(model_dir, h.DEFAULT)
    workload = h.Workload(seed=3, num_blocks=400, max_num_batched_tokens=2048, max_num_seqs=16, watermark=0.0,
                          num_steps=0)
    config.cache_config.num_gpu_blocks = workload.num_blocks
    config.additional_config = {"kvservice": {"address": server.target, "pool_id": "steady"}}
    side = h.Side(h.AsyncScheduler, config, workload)
    for i in range(16):
        side.add(f"r{i}", list(range(3, 35 + i)), 10_000)
    client = side.scheduler.kvservice_client
    steps, inner = [], client.step
    client.step = lambda pool_id, ops: steps.append(ops) or inner(pool_id, ops)
    for step in range(60):
        side.schedule()
        if len(side.pending) >= 2:
            side.update()
        if step == 19:  # every request decodes from here on
            side.scheduler.kv_cache_manager.wait()  # this step's Step counted, if it is still on its way
            steps.clear()
    rows = [sum(len(op.request_ids) if isinstance(op, AllocateBatchOp) else 1 for op in ops) for ops in steps]
    assert len(steps) <= 40 and max(rows) <= 2 and sum(rows) >= 30, rows
    h.check_pool(side.scheduler, "steady decode")
    side.scheduler.shutdown()


def test_the_pipeline_setting(monkeypatch):
    from types import SimpleNamespace

    from kvservice.integrations.vllm.config import KVServiceSettings

    def settings(extra: dict):
        return KVServiceSettings.from_vllm_config(SimpleNamespace(additional_config={"kvservice": extra}))

    assert settings({}).pipeline is True
    assert settings({"pipeline": False}).pipeline is False
    monkeypatch.setenv("KVSERVICE_PIPELINE", "off")
    assert settings({}).pipeline is False
    assert settings({"pipeline": "on"}).pipeline is True  # the config wins over the environment
    with pytest.raises(UnsupportedConfig, match=r"\['pipeline'\] \(or KVSERVICE_PIPELINE\) must be a boolean"):
        settings({"pipeline": "sometimes"})
    assert settings({"pipeline": True}).step_interval_ms == 0.0
    assert settings({"pipeline": True, "step_interval_ms": "50"}).step_interval_ms == 50.0
    monkeypatch.setenv("KVSERVICE_STEP_INTERVAL_MS", "20")
    assert settings({"pipeline": True}).step_interval_ms == 20.0
    for bad in (-1, "soon", float("nan"), 10**6):
        with pytest.raises(UnsupportedConfig, match=r"\['step_interval_ms'\] \(or KVSERVICE_STEP_INTERVAL_MS\) "
                                                    r"must be a number of milliseconds from 0 to 60000, got"):
            settings({"pipeline": True, "step_interval_ms": bad})
    with pytest.raises(UnsupportedConfig, match=r"step_interval_ms'\] = 20.0 needs pipeline on"):
        settings({"pipeline": False})


def test_a_reply_the_checks_cannot_read_is_a_divergence():
    """A packed reply that disagrees (a refusal with no failure result) or cannot even be read is PoolDiverged,
    and every later step raises too."""
    from array import array
    from concurrent.futures import Future

    from kvservice.integrations.vllm.remote import InFlight, RemoteKVCacheManager, Rows
    from kvservice.ops import OpResult, OpStatus, PackedResult, StepResult

    rows = Rows()
    rows.op.request_ids.append("a")
    rows.op.rows.extend([8, 1, 0, 0, 0, 0, 0, 0, 0, 8])
    odd = PackedResult(bytes([OpStatus.NO_SPACE]), array("I", [0]), array("I"), array("I", [8]), array("I", [0]),
                       [], 1)
    short = PackedResult(bytes(1), array("I"), array("I"), array("I", [8]), array("I", [1]), [], 1)  # no counts
    replies = iter([StepResult(1, [OpResult("", batch=odd)], [], 5), StepResult(2, [OpResult("", batch=short)], [], 5)])
    m = object.__new__(RemoteKVCacheManager)  # the checking half only
    m.pool_id, m.num_kv_cache_groups, m._in_flight, m._failed = "p", 1, None, None
    m.client = type("Client", (), {"target": "127.0.0.1:1", "step": lambda self, pool_id, ops: next(replies)})()
    for match in ("row 0 \\(allocation for 'a'\\) with NO_SPACE", "answered a Step the scheduler cannot read"):
        sent = InFlight(Future(), [rows.op], [rows], 5)
        with pytest.raises(PoolDiverged, match=match):
            m._send(sent)
    m._in_flight = InFlight(Future(), [], [], 0)
    m._in_flight.future.set_exception(PoolDiverged("x"))
    with pytest.raises(PoolDiverged):
        m.wait()
    with pytest.raises(PoolDiverged, match="an earlier Step failed"):
        m.wait()
