"""What an operator reads off a fleet (issue 22): a hot standby's /metrics say it is a standby and how far it
follows the WAL, and hold none of its copy of the leader's state (a fleet sum counts each pool once, no
"persistence off" alert fires for a healthy standby); external pools repair a run of lost event batches
from the replay socket, back to what the engine holds."""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.core import FullAttentionSpec, KVCacheConfig
from kvservice.ops import AddRequestOp, AllocateOp
from tests.external_helpers import Publisher, chain, stored, wait_for
from tests.redis_helpers import RedisServer, free_port
from tests.service_helpers import start_server

CONFIG = KVCacheConfig(65, [FullAttentionSpec(16)])  # 64 blocks
PROMTOOL = shutil.which("promtool")


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
