"""The metrics as a real Prometheus (Debian's, installed by `make install` where apt can) scrapes and queries
them (issue 13, point 9): counters that `rate()` can use, one persistence-state series per state, and the
figures an operator expects; `promtool check metrics` accepts the exposition."""

import subprocess
import time
import urllib.request

import pytest

from kvservice.ops import AddRequestOp, AllocateOp, FreeOp
from tests.prometheus_helpers import PROMETHEUS, PROMTOOL, query, wait_ready
from tests.redis_helpers import free_port
from tests.service_helpers import small_config, start_server

pytestmark = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                reason="Debian's prometheus package is not installed (make install installs it)")


def test_a_real_prometheus_scrapes_and_queries_the_metrics(tmp_path):
    metrics_port, prom_port = free_port(), free_port()  # never the same port twice
    server = start_server("--metrics-port", str(metrics_port), "--quota", "acme=100", log_dir=tmp_path)
    (tmp_path / "prometheus.yml").write_text(
        f"global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n"
        f"scrape_configs:\n  - job_name: kvservice\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    try:
        wait_ready(prom, prom_port, tmp_path / "prometheus.log")
        c = server.client()
        c.register_pool("prom", small_config(9, 16), max_model_len=512)  # 8 blocks: evictions come fast
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        deadline = time.monotonic() + 60
        i = 0
        while time.monotonic() < deadline:  # a stream of distinct prompts: each evicts the cached one before it
            prompt = [i * 100 + t for t in range(64)]
            c.step("prom", [AddRequestOp(f"r{i}", token_ids=prompt), AllocateOp(f"r{i}", num_new_tokens=64),
                            FreeOp(f"r{i}")])
            i += 1
            time.sleep(0.05)
            if i % 20 == 0 and query(prom_port, 'rate(kvservice_pool_evictions_total{pool="prom"}[5s]) > 0'):
                break
        else:
            pytest.fail(f"Prometheus never saw evictions grow; its log:\n{(tmp_path / 'prometheus.log').read_text()}")
        # Counters for the hit rate; exactly one persistence state at 1 (here: off, no Redis).
        assert query(prom_port, 'kvservice_pool_prefix_queried_tokens_total{pool="prom"} > 0')
        ratio = query(prom_port, 'sum(rate(kvservice_pool_prefix_hit_tokens_total[10s])) / '
                                 'sum(rate(kvservice_pool_prefix_queried_tokens_total[10s]))')
        assert ratio and float(ratio[0]["value"][1]) == 0.0  # distinct prompts: nothing hits
        states = {r["metric"]["state"]: float(r["value"][1]) for r in query(prom_port, "kvservice_persistence_state")}
        assert set(states) == {"off", "ok", "resyncing", "degraded", "down", "fenced"} and sum(states.values()) == 1
        assert states["off"] == 1
        for name in ("kvservice_pool_capacity_blocks", "kvservice_pool_usage_ratio", "process_resident_memory_bytes",
                     "python_gc_collections_total", "kvservice_wal_entries_total", "kvservice_snapshots_total",
                     "kvservice_leader_epoch", "kvservice_tenant_quota_blocks", "kvservice_event_watchers",
                     "kvservice_pool_pending_transfers", "kvservice_rpc_latency_seconds_bucket"):
            assert query(prom_port, name), f"{name} was not scraped"
        assert float(query(prom_port, 'kvservice_pool_capacity_blocks{pool="prom"}')[0]["value"][1]) == 8
        assert float(query(prom_port, 'kvservice_tenant_quota_blocks{tenant="acme"}')[0]["value"][1]) == 100
        c.close()
    finally:
        prom.terminate()
        prom.wait(10)
        server.stop()
