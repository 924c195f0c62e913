"""vLLM-published external pools: vLLM 0.33.0's own KVCacheManager (events on) and ZmqEventPublisher feed a
real `kvservice serve` over loopback; after every scheduler step, `Lookup` for a set of probe prompts must
equal what that engine's own `get_computed_blocks` answers. Random workloads with eviction churn; the
subscription killed mid-stream (a gap, filled by replay), the publisher restarted, the cache cleared, the
allocator killed with -9 and restarted.

Runs in the project's vLLM environment only (make vllm-env):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:$HOME/.cache/kvservice/vllm-0.33.0/src \\
        ~/.cache/kvservice/vllm-0.33.0/venv/bin/python -m pytest -q tests/vllm/test_external_vllm.py
"""

from __future__ import annotations

import random
import signal
import time

import pytest
import zmq

pytest.importorskip("vllm", reason="needs the vLLM 0.33.0 environment (make vllm-env; see this file's docstring)")

from tests.external_helpers import wait_for  # noqa: E402
from tests.redis_helpers import free_port  # noqa: E402
from tests.service_helpers import start_server  # noqa: E402
from tests.vllm.vllm_engine import BLOCK, Proxy, VllmEngine, random_step  # noqa: E402

POOL = "vllm-0"


def loopback(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def restarted(make, timeout_s: float = 10.0):
    """A new engine on the old one's ports, once the kernel has released them."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return make()
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def prefixes(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(1000) for _ in range(n)] for n in (16, 40, 64, 100)]


class Checker:
    """Compares kvservice's Lookup with the engine's get_computed_blocks for probe prompts."""

    def __init__(self, client, engine: VllmEngine, probes: list[list[int]]) -> None:
        self.client = client
        self.engine = engine
        self.probes = probes
        self.steps = 0
        self.epoch = 0  # the publisher incarnation kvservice must have reached (a restart makes a new one)

    def applied(self, timeout_s: float = 20.0) -> None:
        last = self.engine.num_published - 1
        wait_for(lambda: self._position() >= (self.epoch, last), timeout_s, what=f"batch {last} applied")

    def _position(self) -> tuple[int, int]:
        pools = self.client.get_stats().external_pools
        return (pools[POOL].epoch, pools[POOL].last_sequence) if POOL in pools else (-1, -2)

    def check(self, extra: list[list[int]] = ()) -> None:
        self.applied()
        for prompt in [*self.probes, *extra]:
            ours = self.client.lookup(prompt).tokens(POOL)
            theirs = self.engine.computed_tokens(prompt)
            assert ours == theirs, (self.steps, len(prompt), ours, theirs)
        self.steps += 1

    def stats(self):
        return self.client.get_stats().external_pools[POOL]


def churn(engine: VllmEngine, checker: Checker, rng: random.Random, families: list[list[int]], steps: int) -> None:
    for _ in range(steps):
        random_step(engine, rng, families)
        engine.step()
        recent = [list(r.prompt_token_ids) + list(r.output_token_ids) for r in engine.running[:2]]
        checker.check(recent)


def test_churn_gap_replay_and_clear_equal_get_computed_blocks(tmp_path):
    rng = random.Random(17)
    families = prefixes(rng)
    up, down, replay = free_port(), free_port(), free_port()
    proxy = Proxy(up, down)
    engine = VllmEngine(loopback(up), loopback(replay), num_blocks=48)
    flag = f"{POOL}={loopback(down)},replay={loopback(replay)},block-size={BLOCK},hash=sha256"
    server = start_server("--hash-block-size", str(BLOCK), "--vllm-events", flag, log_dir=tmp_path)
    try:
        with server.client(hash_block_size=BLOCK) as client:
            wait_for(lambda: client.get_stats().external_pools[POOL].connected, what="subscribed")
            probes = [f + [1, 2, 3] for f in families] + [f[:BLOCK * 2 + 1] for f in families]
            checker = Checker(client, engine, probes)
            churn(engine, checker, rng, families, 40)
            assert checker.stats().evictions == 0 and checker.stats().removed_blocks > 0  # vLLM evicted

            proxy.drop(3)  # batches lost on the way: a gap, filled from vLLM's replay buffer
            churn(engine, checker, rng, families, 10)
            assert checker.stats().gaps >= 1 and checker.stats().resyncs == 0

            proxy.cut()  # the subscription killed mid-stream: vLLM keeps publishing into the void
            for _ in range(8):
                random_step(engine, rng, families)
                engine.step()
            time.sleep(0.3)
            proxy.heal()  # kvservice reconnects and catches up by replay
            churn(engine, checker, rng, families, 10)

            for req in list(engine.running):  # vLLM's reset_prefix_cache needs every request finished
                engine.free(req)
            assert engine.manager.reset_prefix_cache()
            engine.step()  # AllBlocksCleared
            checker.check()
            assert checker.stats().clears == 1 and checker.stats().tiers["GPU"] == 0
            churn(engine, checker, rng, families, 15)
            s = checker.stats()
            assert s.spec_status == "ok", (s.spec_message, s.spec_blocks_checked)  # vLLM sha256, block for block
            assert s.restarts == 0 and s.decode_errors == 0 and s.ignored_events == 0
    finally:
        server.stop()
        engine.shutdown()
        proxy.close()


def test_publisher_restart_and_a_wrong_declared_spec(tmp_path):
    rng = random.Random(23)
    families = prefixes(rng)
    sub, replay = free_port(), free_port()
    # The engine's PUB connects to kvservice, which binds (vLLM connects when its endpoint names a host).
    flag = f"{POOL}={loopback(sub)},bind,replay={loopback(replay)},hash=sha256_cbor"
    server = start_server("--hash-block-size", str(BLOCK), "--vllm-events", flag, log_dir=tmp_path)
    engine = VllmEngine(loopback(sub), loopback(replay), num_blocks=40)
    try:
        with server.client(hash_block_size=BLOCK) as client:
            wait_for(lambda: client.get_stats().external_pools[POOL].connected, what="publisher connected")
            probes = [f + [5] for f in families]
            checker = Checker(client, engine, probes)
            churn(engine, checker, rng, families, 20)
            s = checker.stats()
            assert s.spec_status == "mismatch" and "they match hash=sha256" in s.spec_message  # declared wrong
            engine.shutdown()
            engine = restarted(lambda: VllmEngine(loopback(sub), loopback(replay), num_blocks=40))  # empty, seq 0
            checker.engine, checker.epoch = engine, 1
            churn(engine, checker, rng, families, 20)
            s = checker.stats()
            assert s.restarts == 1 and s.epoch == 1
    finally:
        server.stop()
        engine.shutdown()


def test_allocator_kill_9_restart_catches_up(tmp_path):
    rng = random.Random(31)
    families = prefixes(rng)
    up, down, replay = free_port(), free_port(), free_port()
    proxy = Proxy(up, down)
    engine = VllmEngine(loopback(up), loopback(replay), num_blocks=48)
    flag = f"{POOL}={loopback(down)},replay={loopback(replay)},block-size={BLOCK}"
    args = ("--hash-block-size", str(BLOCK), "--vllm-events", flag, "--data-dir", str(tmp_path / "data"))
    server = start_server(*args, persistence=True, log_dir=tmp_path)
    try:
        with server.client(hash_block_size=BLOCK) as client:
            wait_for(lambda: client.get_stats().external_pools[POOL].connected, what="subscribed")
            checker = Checker(client, engine, [f + [9] for f in families])
            churn(engine, checker, rng, families, 25)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        for _ in range(10):  # the engine goes on while the allocator is down
            random_step(engine, rng, families)
            engine.step()
        server = start_server(*args, persistence=True, log_dir=tmp_path)
        with server.client(hash_block_size=BLOCK) as client:
            checker.client = client
            churn(engine, checker, rng, families, 15)
            s = checker.stats()
            assert s.restarts == 0 and s.resyncs == 0 and s.epoch == 0
    finally:
        server.stop()
        engine.shutdown()
        proxy.close()


class _Dropping:
    """vLLM's own PUB socket, losing the next `drop` frames it is asked to send (they stay in its replay
    buffer: the publisher thread buffers each batch after sending it)."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.drop = 0

    def send_multipart(self, parts, *args, **kwargs):
        if self.drop:
            self.drop -= 1
            return None
        return self.sock.send_multipart(parts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sock, name)


class _Stalling:
    """vLLM's own replay ROUTER, left unserved until `until` (a publisher thread busy with a long queue)."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.until = 0.0

    def poll(self, *args, **kwargs):
        return 0 if time.monotonic() < self.until else self.sock.poll(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_a_run_of_lost_batches_is_repaired(tmp_path):
    """Runs of consecutive batches lost by vLLM's PUB socket (kept in its replay buffer), each ending with a
    delivered batch that evicts blocks stored during the run: Lookup equals get_computed_blocks again, for the
    run's prompts and for those cached long before it, also when the replay answers after the subscription's
    3 s replay timeout (it is asked again; the index is never dropped meanwhile)."""
    rng = random.Random(41)
    sub, replay = free_port(), free_port()
    engine = VllmEngine(f"tcp://*:{sub}", loopback(replay), num_blocks=24)
    pub = engine.publisher._pub = _Dropping(engine.publisher._pub)
    router = engine.publisher._replay = _Stalling(engine.publisher._replay)
    flag = f"{POOL}={loopback(sub)},replay={loopback(replay)},block-size={BLOCK},hash=sha256"
    server = start_server("--hash-block-size", str(BLOCK), "--vllm-events", flag, log_dir=tmp_path)
    try:
        with server.client(hash_block_size=BLOCK) as client:
            wait_for(lambda: client.get_stats().external_pools[POOL].connected, what="subscribed")
            old = [[rng.randrange(1000) for _ in range(65)] for _ in range(2)]  # held by running requests
            for prompt in old:
                assert engine.admit(prompt)
            engine.step()
            checker = Checker(client, engine, old)
            checker.check()
            assert [engine.computed_tokens(p) for p in old] == [64, 64]
            for stall_s in (0.0, 4.5):
                run = [[rng.randrange(1000) for _ in range(33)] for _ in range(4)]
                pub.drop = len(run)
                for prompt in run:  # each step stores a prompt's 2 blocks, freed at once (evictable)
                    assert engine.admit(prompt)
                    engine.free(engine.running[-1])
                    engine.step()
                wait_for(lambda: pub.drop == 0, what="the run sent")  # vLLM's publisher thread sends
                cached = [engine.computed_tokens(p) for p in run]
                router.until = time.monotonic() + stall_s
                assert engine.admit([rng.randrange(1000) for _ in range(16 * 9)])  # evicts blocks of the run
                engine.step()  # delivered
                assert [engine.computed_tokens(p) for p in run] != cached  # it removed some of the run's blocks
                if stall_s:
                    time.sleep(3.5)  # the first replay went unanswered: the index as of the gap is kept
                    assert [client.lookup(p).tokens(POOL) for p in old] == [64, 64]
                engine.free(engine.running[-1])
                engine.step()
                checker.check(run)
            s = checker.stats()
            assert s.gaps >= 2 and s.resyncs == 0 and s.restarts == 0 and s.removed_blocks > 0
    finally:
        server.stop()
        engine.shutdown()
