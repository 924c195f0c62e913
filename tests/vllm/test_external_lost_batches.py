"""Runs of lost KV-event batches against vLLM 0.33.0's own KVCacheManager and ZmqEventPublisher (issue 35):
the engine binds its PUB and replay ROUTER sockets and a real `kvservice serve --vllm-events` connects; 26
blocks of 16 tokens, hash sha256_cbor, vLLM's default int block hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES),
a seeded random shared-prefix workload, one batch per scheduler step.

Runs in the project's vLLM environment only (make vllm-env):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        ~/.cache/kvservice/vllm-0.33.0/venv/bin/python -m pytest -q tests/vllm/test_external_lost_batches.py
"""

from __future__ import annotations

import random
import re
import time

import pytest
import zmq

pytest.importorskip("vllm", reason="needs the vLLM 0.33.0 environment (make vllm-env; see this file's docstring)")

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from tests.external_helpers import wait_for  # noqa: E402
from tests.redis_helpers import free_port  # noqa: E402
from tests.service_helpers import start_server  # noqa: E402
from tests.vllm.test_external_vllm import POOL, Checker, loopback, prefixes  # noqa: E402
from tests.vllm.vllm_engine import BLOCK, VllmEngine, random_step  # noqa: E402

RUN = 12
NUM_BLOCKS = 26
RESYNC_BOUND_S = 3.0 + 10.0 + 5.0  # README: a replay silent 3 s, asked again for 10 s; then a margin


class _Losing:
    """vLLM's own PUB socket, not sending the batches numbered in `lost`. By default the send returns, so
    vLLM's publisher thread buffers the batch for replay, as it does a frame a subscriber's full queue dropped;
    with `fail`, the send raises and vLLM leaves the batch out of its replay buffer for good."""

    def __init__(self, sock, fail: bool = False) -> None:
        self.sock = sock
        self.fail = fail
        self.lost: set[int] = set()

    def send_multipart(self, parts, *args, **kwargs):
        if int.from_bytes(parts[1], "big") not in self.lost:
            return self.sock.send_multipart(parts, *args, **kwargs)
        if self.fail:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        return None

    def __getattr__(self, name):
        return getattr(self.sock, name)


class Harness:
    def __init__(self, tmp_path, seed: int, fail: bool = False, serve: bool = True, buffer_steps: int = 10_000) -> None:
        self.rng = random.Random(seed)
        self.families = prefixes(self.rng)
        sub, replay = free_port(), free_port()
        self.engine = VllmEngine(f"tcp://*:{sub}", f"tcp://*:{replay}", num_blocks=NUM_BLOCKS, hash_algo="sha256_cbor",
                                 buffer_steps=buffer_steps)
        self.pub = self.engine.publisher._pub = _Losing(self.engine.publisher._pub, fail)
        self.flag = f"{POOL}={loopback(sub)},replay={loopback(replay)},block-size={BLOCK},hash=sha256_cbor"
        self.tmp_path = tmp_path
        self.server = None
        if serve:
            self.serve()
        self.probes = [f + [1, 2, 3] for f in self.families] + [f[:BLOCK * 2 + 1] for f in self.families]

    def serve(self) -> None:
        self.server = start_server("--vllm-events", self.flag, log_dir=self.tmp_path)

    def publish(self, lost: bool = False) -> tuple[int, list] | None:
        """This step's events as one batch (vLLM's scheduler publishes none for a step without events)."""
        events = self.engine.manager.take_events()
        if not events:
            return None
        seq = self.engine.num_published
        if lost:
            self.pub.lost.add(seq)
        self.engine.publisher.publish(KVEventBatch(ts=time.time(), events=events))
        self.engine.num_published += 1
        return seq, events

    def step(self, lost: bool = False) -> tuple[int, list] | None:
        random_step(self.engine, self.rng, self.families)
        return self.publish(lost)

    def running(self) -> list[list[int]]:
        return [list(r.prompt_token_ids) + list(r.output_token_ids) for r in self.engine.running]

    def lost_run(self) -> set:
        """RUN consecutive lost batches; the block hashes they stored."""
        stored, lost = set(), 0
        while lost < RUN:
            batch = self.step(lost=True)
            if batch is not None:
                lost += 1
                stored |= {h for e in batch[1] if isinstance(e, BlockStored) for h in e.block_hashes}
        return stored

    def evicting_batch(self) -> tuple[int, set]:
        """A delivered batch that evicts nearly every cached block: the engine's requests finish and a prompt
        of fresh tokens takes all free blocks but one. (its number, the block hashes it removed)"""
        for req in list(self.engine.running):
            self.engine.free(req)
        free = self.engine.manager.block_pool.get_num_free_blocks()
        assert self.engine.admit([self.rng.randrange(1000, 2000) for _ in range(BLOCK * (free - 1))])
        seq, events = self.publish()
        return seq, {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.engine.shutdown()


def logged_repairs(log_text: str) -> set[int]:
    return {seq for a, b in re.findall(r"batches (\d+)\.\.(\d+) applied from the replay socket", log_text)
            for seq in range(int(a), int(b) + 1)}


def test_a_run_of_12_lost_batches_in_a_shared_prefix_workload(tmp_path, monkeypatch):
    """Single lost batches, then 12 consecutive ones (kept in vLLM's replay buffer) ending with a delivered batch
    that evicts blocks stored during the run (batch 26): after every delivered batch Lookup equals
    get_computed_blocks, the index is never dropped, and the allocator logs each batch it replayed."""
    monkeypatch.setenv("KVSERVICE_TEST_LOG_LEVEL", "INFO")
    h = Harness(tmp_path, seed=35)
    try:
        with h.server.client(hash_block_size=BLOCK) as client:
            wait_for(lambda: client.get_stats().external_pools[POOL].connected, what="subscribed")
            checker = Checker(client, h.engine, h.probes)
            while h.engine.num_published < 14:  # batches 4 and 8 lost alone
                batch = h.step(lost=h.engine.num_published in (4, 8))
                if batch is not None and batch[0] not in h.pub.lost:
                    checker.check(h.running())
            stored = h.lost_run()  # batches 14..25
            seq, removed = h.evicting_batch()
            assert seq == 14 + RUN and removed & stored  # it removes blocks stored during the run
            checker.check(h.running())
            h.engine.free(h.engine.running[-1])
            for _ in range(12):
                if h.step() is not None:
                    checker.check(h.running())
            s = checker.stats()
            assert s.resyncs == 0 and s.restarts == 0 and s.gaps >= 3 and s.removed_blocks > 0
            assert h.pub.lost <= logged_repairs(h.server.log.read_text())
    finally:
        h.close()


def test_batches_missing_from_the_replay_buffer_resync_within_the_bound(tmp_path, monkeypatch):
    """A run whose sends failed (vLLM buffers none of it): the replay answers without it. The allocator says so,
    keeps the index as of the batch before the run meanwhile (stale, not empty), and resyncs within the bound;
    from then on Lookup never reports a block the engine has not cached, and finds what it caches since."""
    monkeypatch.setenv("KVSERVICE_TEST_LOG_LEVEL", "INFO")
    h = Harness(tmp_path, seed=36, fail=True)
    try:
        with h.server.client(hash_block_size=BLOCK) as client:
            wait_for(lambda: client.get_stats().external_pools[POOL].connected, what="subscribed")
            checker = Checker(client, h.engine, h.probes)
            while h.engine.num_published < 10:
                if h.step() is not None:
                    checker.check(h.running())
            before = [client.lookup(p).tokens(POOL) for p in h.probes]
            assert any(before)
            gaps = checker.stats().gaps
            h.lost_run()
            seq, _ = h.evicting_batch()
            wait_for(lambda: checker.stats().gaps > gaps, what=f"the gap before batch {seq} seen")
            assert [client.lookup(p).tokens(POOL) for p in h.probes] == before  # held: the index as of batch 9
            wait_for(lambda: checker.stats().resyncs == 1, RESYNC_BOUND_S, what="the resync")
            log = h.server.log.read_text()
            assert f"has batch {seq} after 9" in log and "dropping the index" in log
            fresh = [h.rng.randrange(2000, 3000) for _ in range(BLOCK * 3 + 1)]
            for req in list(h.engine.running):
                h.engine.free(req)
            assert h.engine.admit(fresh)
            h.publish()
            checker.applied()
            for prompt in [*h.probes, *h.running()]:
                assert client.lookup(prompt).tokens(POOL) <= h.engine.computed_tokens(prompt), prompt
            assert client.lookup(fresh).tokens(POOL) == h.engine.computed_tokens(fresh) == BLOCK * 3
    finally:
        h.close()


@pytest.mark.parametrize("num_lost", [1, 7, 12])
def test_the_first_batches_lost_are_asked_from_the_replay(tmp_path, monkeypatch, num_lost):
    """The engine's very first batches are lost on the PUB socket (kept in vLLM's replay buffer), so the first
    batch the allocator ever receives is `num_lost`: it asks the replay from batch 0 before applying it, and
    from then on Lookup equals get_computed_blocks, with no resync."""
    monkeypatch.setenv("KVSERVICE_TEST_LOG_LEVEL", "INFO")
    h = Harness(tmp_path, seed=43 + num_lost)
    try:
        with h.server.client(hash_block_size=BLOCK) as client:
            wait_for(lambda: client.get_stats().external_pools[POOL].connected, what="subscribed")
            checker = Checker(client, h.engine, h.probes)
            lost = 0
            while lost < num_lost:  # published back to back: no idle catch-up comes between them
                lost += h.step(lost=True) is not None
            delivered = 0
            while delivered < 8:
                if h.step() is not None:
                    delivered += 1
                    checker.check(h.running())
            s = checker.stats()
            assert s.resyncs == 0 and s.restarts == 0 and s.gaps >= 1
            assert set(range(num_lost)) <= logged_repairs(h.server.log.read_text())
    finally:
        h.close()


@pytest.mark.parametrize("buffer_steps", [10_000, 20], ids=["buffer-reaches-back", "buffer-cut"])
def test_an_allocator_started_after_50_batches_learns_what_the_buffer_holds(tmp_path, monkeypatch, buffer_steps):
    """An allocator connecting to an engine that has published 50 batches (to no subscriber): with the whole
    stream in vLLM's replay buffer, Lookup equals get_computed_blocks at once; with a buffer of the last 20
    batches only, that is a resync, counted and logged, and Lookup never reports a block the engine does not
    hold (and equals it for what is cached from then on)."""
    monkeypatch.setenv("KVSERVICE_TEST_LOG_LEVEL", "INFO")
    h = Harness(tmp_path, seed=4350, serve=False, buffer_steps=buffer_steps)
    try:
        while h.engine.num_published < 50:
            h.step()
        publisher = h.engine.publisher
        wait_for(lambda: len(publisher._buffer) == min(50, buffer_steps), what="vLLM's publisher sent all 50")
        h.serve()
        with h.server.client(hash_block_size=BLOCK) as client:
            wait_for(lambda: client.get_stats().external_pools[POOL].connected, what="subscribed")
            checker = Checker(client, h.engine, h.probes)
            checker.applied()
            log = h.server.log.read_text()
            if buffer_steps > 50:
                checker.check(h.running())
                assert checker.stats().resyncs == 0 and set(range(50)) <= logged_repairs(log)
                return
            assert checker.stats().resyncs == 1
            assert "batches 0..29 are not in the publisher's replay buffer any more" in log
            for prompt in [*h.probes, *h.running()]:
                assert client.lookup(prompt).tokens(POOL) <= h.engine.computed_tokens(prompt), prompt
            fresh = [h.rng.randrange(2000, 3000) for _ in range(BLOCK * 3 + 1)]
            for req in list(h.engine.running):
                h.engine.free(req)
            assert h.engine.admit(fresh)
            h.publish()
            checker.applied()
            assert client.lookup(fresh).tokens(POOL) == h.engine.computed_tokens(fresh) == BLOCK * 3
    finally:
        h.close()
