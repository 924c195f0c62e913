"""What an operator reads off a fleet (issue 22): a hot standby's /metrics say it is a standby and how far it
follows the WAL, and hold none of its copy of the leader's state (a fleet sum counts each pool once, no
"persistence off" alert fires for a healthy standby); external pools repair a run of lost event batches
from the replay socket, back to what the engine holds."""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.ops import AddRequestOp, AllocateOp
from tests.external_helpers import Publisher, chain, removed, stored, wait_for
from tests.redis_helpers import RedisServer, free_port
from tests.service_helpers import start_server

CONFIG = KVCacheConfig(65, [FullAttentionSpec(16)])  # 64 blocks
PROMTOOL = shutil.which("promtool")
B = 4  # the external pools' block size (and the allocator's hash block size)


def scrape(port: int) -> tuple[bytes, dict[str, dict[tuple, float]]]:
    """The exposition, and {sample name: {sorted labels: value}}."""
    raw = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return raw, samples


def role(samples) -> dict[str, float]:
    return {dict(k)["role"]: v for k, v in samples.get("kvservice_role", {}).items()}


def fleet_sum(scrapes, name: str) -> float:
    return sum(sum(s.get(name, {}).values()) for s in scrapes)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis", appendfsync="always")
    server.start()
    yield server
    server.stop()


def test_a_standby_exports_its_role_and_lag_and_none_of_the_leaders_figures(redis_server, tmp_path):
    ports = {"leader": free_port(), "standby": free_port()}
    common = ("--redis-url", redis_server.url, "--redis-namespace", "obs", "--leader-lease", "1",
              "--hash-block-size", "4")
    leader = start_server(*common, "--metrics-port", str(ports["leader"]), persistence=True, log_dir=tmp_path)
    standby = start_server(*common, "--standby", "--metrics-port", str(ports["standby"]), persistence=True,
                           log_dir=tmp_path)
    publisher = Publisher()
    try:
        with leader.client(hash_block_size=4) as client:
            client.register_pool("obs-p", CONFIG, max_model_len=512)
            client.register_external_pool("obs-ext", publisher.endpoint, publisher.replay_endpoint, block_size=4)
            prompt = list(range(9))
            wait_for(lambda: client.get_stats().external_pools["obs-ext"].connected, what="subscribed")
            seq = publisher.publish(stored(chain(prompt), None, prompt[:8]))
            wait_for(lambda: client.get_stats().external_pools["obs-ext"].last_sequence >= seq, what="ingested")
            for i in range(5):
                client.step("obs-p", [AddRequestOp(f"r{i}", token_ids=list(range(i, i + 40))),
                                      AllocateOp(f"r{i}", num_new_tokens=40)])

            def standby_current():
                _, s = scrape(ports["standby"])
                return s if (s.get("kvservice_standby_applied_entries_total", {}).get((), 0) >= 7
                             and s["kvservice_standby_lag_entries"][()] == 0) else None

            sb = wait_for(standby_current, timeout_s=30, what="the standby applied the leader's WAL")
            raw_leader, ld = scrape(ports["leader"])
            raw_standby, _ = scrape(ports["standby"])

            assert role(ld) == {"leader": 1.0, "standby": 0.0}
            assert ld["kvservice_persistence_state"][(("state", "ok"),)] == 1.0
            assert role(sb) == {"leader": 0.0, "standby": 1.0}
            assert sb["kvservice_standby_consistent"][()] == 1.0
            lag_s = sb["kvservice_standby_lag_seconds"][()]
            assert not math.isnan(lag_s) and 0 <= lag_s < 30
            # None of the standby's copy of the state: no persistence state (its own journal is unused), no
            # pool, tenant, session, journal or external-pool figures.
            copied = [n for n in sb if n.startswith(("kvservice_persistence", "kvservice_pool_", "kvservice_tenant_",
                                                     "kvservice_sessions", "kvservice_wal_", "kvservice_snapshot",
                                                     "kvservice_leader_epoch", "kvservice_external_"))]
            assert copied == []
            assert not any(n.startswith("kvservice_standby_") for n in ld)
            # A fleet-wide sum counts each pool once.
            assert fleet_sum([ld, sb], "kvservice_pool_capacity_blocks") == 64
            assert fleet_sum([ld, sb], "kvservice_external_blocks_indexed") == 2
            if PROMTOOL:
                for raw in (raw_leader, raw_standby):
                    check = subprocess.run([PROMTOOL, "check", "metrics"], input=raw, capture_output=True, timeout=30)
                    assert check.returncode == 0, check.stdout + check.stderr

        leader.proc.send_signal(signal.SIGKILL)  # the standby takes over: it leads, and exports as a leader
        leader.proc.wait(10)

        def took_over():
            _, s = scrape(ports["standby"])
            return s if role(s).get("leader") == 1.0 and "kvservice_pool_capacity_blocks" in s else None

        new = wait_for(took_over, timeout_s=30, what="the standby took over")
        assert role(new) == {"leader": 1.0, "standby": 0.0}
        assert new["kvservice_persistence_state"][(("state", "ok"),)] == 1.0
        assert new["kvservice_pool_capacity_blocks"][(("pool", "obs-p"),)] == 64
        assert not any(n.startswith("kvservice_standby_") for n in new)
    finally:
        publisher.close()
        leader.stop()
        standby.stop()


class Engine:
    """The engine side of an external pool, as vLLM's events describe it: which blocks it holds (a count per
    block hash, as vLLM caches a block twice when two requests computed it), published through `publisher`;
    `computed(prompt)` is what its get_computed_blocks answers (whole blocks, never the last token)."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.held: dict[bytes, int] = {}

    def store(self, prompt: list[int]) -> int:
        hashes = chain(prompt)
        for h in hashes:
            self.held[h] = self.held.get(h, 0) + 1
        return self.publisher.publish(stored(hashes, None, prompt[:len(hashes) * B]))

    def remove(self, block_hash: bytes) -> int:
        self.held[block_hash] -= 1
        if not self.held[block_hash]:
            del self.held[block_hash]
        return self.publisher.publish(removed([block_hash]))

    def computed(self, prompt: list[int]) -> int:
        n = 0
        for h in chain(prompt)[:(len(prompt) - 1) // B]:
            if h not in self.held:
                break
            n += 1
        return n * B


def test_a_run_of_lost_batches_is_repaired_from_the_replay_socket(tmp_path):
    """Several consecutive batches lost on the wire (still in the engine's replay buffer), the run ending with a
    delivered batch that removes a block stored during it: the index equals the engine again, also when the
    replay answers only after the subscription's replay timeout (before: the index was dropped, and Lookup
    answered 0 for every prompt of the engine, also for blocks stored long before the run, for good)."""
    publisher = Publisher()
    flag = f"vllm-0={publisher.endpoint},replay={publisher.replay_endpoint},block-size={B},hash=sha256_cbor"
    server = start_server("--hash-block-size", str(B), "--vllm-events", flag, log_dir=tmp_path)
    engine = Engine(publisher)
    old = [[1000 * i + t for t in range(4 * (i + 2) + 1)] for i in range(4)]  # 8..20 tokens cached
    try:
        with server.client(hash_block_size=B) as client:
            ext = lambda: client.get_stats().external_pools["vllm-0"]  # noqa: E731
            wait_for(lambda: ext().connected, what="subscribed")

            def lookups(prompts):
                return [client.lookup(p).tokens("vllm-0") for p in prompts]

            def settled(prompts):
                last = publisher.next_seq - 1
                wait_for(lambda: ext().last_sequence == last, timeout_s=30, what=f"batch {last} applied")
                return lookups(prompts), [engine.computed(p) for p in prompts]

            for prompt in old:
                engine.store(prompt)
            ours, theirs = settled(old)
            assert ours == theirs == [8, 12, 16, 20]

            for run, stall_s in enumerate((0.0, 4.5)):  # the subscription waits 3 s for a replay
                new = [[50_000 + 1000 * (10 * run + i) + t for t in range(9)] for i in range(4)]
                publisher.drop(4)  # the run: 4 batches lost, each storing a new prompt's blocks
                for prompt in new:
                    engine.store(prompt)
                publisher.stall_replays(stall_s)
                engine.remove(chain(new[2])[1])  # delivered: removes a block stored during the run
                if stall_s:
                    time.sleep(3.5)  # the first replay request went unanswered: the index is kept meanwhile
                    assert lookups(old) == [engine.computed(p) for p in old]
                ours, theirs = settled(old + new)
                assert ours == theirs, (run, ours, theirs)
                assert theirs[len(old):] == [8, 8, 4, 8]
            s = ext()
            assert s.resyncs == 0 and s.restarts == 0 and s.gaps >= 2
    finally:
        server.stop()
        publisher.close()


def test_a_gap_whose_replay_never_answers_resyncs_within_the_bound(tmp_path):
    """The bound's other side: a replay socket that never answers leaves the index as of the gap (never
    emptied) until `resync_after_s` (10 s) has passed, then resyncs from what arrived."""
    publisher = Publisher()
    flag = f"vllm-0={publisher.endpoint},replay={publisher.replay_endpoint},block-size={B},hash=sha256_cbor"
    server = start_server("--hash-block-size", str(B), "--vllm-events", flag, log_dir=tmp_path)
    engine = Engine(publisher)
    old, new = list(range(13)), list(range(100, 109))
    try:
        with server.client(hash_block_size=B) as client:
            ext = lambda: client.get_stats().external_pools["vllm-0"]  # noqa: E731
            wait_for(lambda: ext().connected, what="subscribed")
            seq = engine.store(old)
            wait_for(lambda: ext().last_sequence == seq, what="batch applied")
            publisher.stall_replays(600)
            publisher.drop(1)
            engine.store(list(range(200, 209)))
            seq = engine.store(new)  # delivered, past the gap
            time.sleep(4)
            assert client.lookup(old).tokens("vllm-0") == 12 and ext().resyncs == 0  # held, not dropped
            wait_for(lambda: ext().resyncs == 1, timeout_s=40, what="the resync")
            assert ext().last_sequence == seq
            assert client.lookup(new).tokens("vllm-0") == 8  # what arrived after the gap
            assert client.lookup(old).tokens("vllm-0") == 0  # unknown after a resync: never reported
    finally:
        server.stop()
        publisher.close()
