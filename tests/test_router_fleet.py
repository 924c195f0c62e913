"""`kvservice route`'s fleet, tenants, policies and P/D, in front of stub engines (tests/router_stub.py) and a
real `kvservice serve`: ejection and readmission on health, the backends file re-read, tenants seeing only
their pools, each policy's choice, the P/D hand-over, its metrics, and the `kvservice route` command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.metric_docs import named_series, unexported
from tests.redis_helpers import free_port
from tests.router_helpers import LoopThread, Rig, cache_prompt, metric
from tests.service_helpers import REPO, start_server


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def allocator(tmp_path_factory):
    d = tmp_path_factory.mktemp("alloc")
    (d / "tokens").write_text("tok-a tenant-a\ntok-b tenant-b\n")
    server = start_server("--token-file", str(d / "tokens"), log_dir=d)
    yield server
    server.stop()


def prompt(seed: int, n: int = 80) -> list[int]:
    return [(seed * 104729 + i * 17) % 30000 + 1 for i in range(n)]


def test_a_dead_engine_is_ejected_and_readmitted(loop, allocator):
    rig = Rig(loop, allocator.target, ["h0", "h1"], policy="round-robin", token="tok-a", eject_after=2,
              readmit_after=2)
    try:
        loop.call(setattr, rig.state("h0"), "healthy", False)
        rig.wait(lambda: not rig.router.fleet.engines["h0"].up, what="h0 ejected")
        assert {rig.post("/v1/completions", {"prompt": prompt(i)}).headers["x-kvservice-engine"]
                for i in range(4)} == {"h1"}
        loop.call(setattr, rig.state("h0"), "healthy", True)
        rig.wait(lambda: rig.router.fleet.engines["h0"].up, what="h0 readmitted")
        assert {rig.post("/v1/completions", {"prompt": prompt(i)}).headers["x-kvservice-engine"]
                for i in range(4)} == {"h0", "h1"}
        loop.call(setattr, rig.state("h1"), "healthy", False)
        loop.call(setattr, rig.state("h0"), "healthy", False)
        rig.wait(lambda: not rig.router.fleet.up(), what="both ejected")
        reply = rig.post("/v1/completions", {"prompt": [1, 2, 3]})
        assert reply.status == 503 and reply.json()["error"]["type"] == "ServiceUnavailableError"
        assert rig.get("/health").status == 503
        page = rig.get("/metrics").body.decode()
        assert metric(page, "kvservice_router_ejections_total", engine="h0") == 2
        assert metric(page, "kvservice_router_readmissions_total", engine="h0") == 1
    finally:
        rig.close()


def test_the_backends_file_is_re_read_when_it_changes(loop, allocator, tmp_path):
    rig = Rig(loop, allocator.target, ["f0", "f1"], token="tok-a")
    try:
        urls = {n: s.url for n, s in rig.stubs.items()}
        path = tmp_path / "fleet.yaml"
        path.write_text(f"backends:\n  - name: f0\n    url: {urls['f0']}\n")
        loop.call(setattr, rig.router.settings, "backends", [])  # the file alone names the fleet now
        loop.call(setattr, rig.router.settings, "backends_file", str(path))
        rig.wait(lambda: {e.backend.name for e in rig.router.fleet.up()} == {"f0"}, what="f0 only")
        assert rig.post("/v1/completions", {"prompt": prompt(1)}).headers["x-kvservice-engine"] == "f0"
        path.write_text(json.dumps([{"name": "f1", "url": urls["f1"], "pool": "f1"}]))
        rig.wait(lambda: {e.backend.name for e in rig.router.fleet.up()} == {"f1"}, what="f0 gone, f1 up")
        assert rig.post("/v1/completions", {"prompt": prompt(1)}).headers["x-kvservice-engine"] == "f1"
        path.write_text("backends: [{name: f1, url: ftp://nowhere}]")  # refused: the fleet stays
        rig.wait(lambda: metric(rig.get("/metrics").body.decode(), "kvservice_router_backends_file_errors_total") == 1,
                 what="the bad file counted")
        assert set(rig.router.fleet.engines) == {"f1"}
    finally:
        rig.close()


def test_each_tenant_sees_only_its_own_pools(loop, allocator, tmp_path):
    with allocator.client("tok-a") as client:
        tokens = prompt(5)
        cache_prompt(client, "t1", tokens)  # tenant-a's pool
    (tmp_path / "tenants.json").write_text(json.dumps({"client-a": "tok-a", "client-b": "tok-b"}))
    rig = Rig(loop, allocator.target, ["t0", "t1"], tenant_tokens=str(tmp_path / "tenants.json"))
    try:
        body = {"prompt": tokens}
        as_a = rig.post("/v1/route", body, {"Authorization": "Bearer client-a"}).json()
        as_b = rig.post("/v1/route", body, {"Authorization": "Bearer client-b"}).json()
        assert as_a["engine"] == "t1" and as_a["hits"]["t1"] == 64 and as_a["lookup_ok"]
        assert as_b["lookup_ok"] and "t1" not in as_b["hits"] and as_b["predicted_cached_tokens"] == 0
        reply = rig.post("/v1/completions", body, {"Authorization": "Bearer client-b"})
        assert reply.status == 200 and reply.headers["x-kvservice-predicted-cached-tokens"] == "0"
        for headers in ({}, {"Authorization": "Bearer client-c"}):
            reply = rig.post("/v1/completions", body, headers)
            assert reply.status == 401 and reply.json() == {"error": "Unauthorized"}
        assert rig.get("/v1/models").status == 401 and rig.get("/health").status == 200
    finally:
        rig.close()


def test_each_policy_picks_as_it_says(loop, allocator):
    rig = Rig(loop, allocator.target, ["p0", "p1", "p2"], token="tok-a")
    try:
        engines = rig.router.decider

        def picks(policy: str, user: str | None = None, seed: int = 0) -> str:
            async def go():
                d = await engines.decide(prompt(seed), None, "tok-a", user, None, policy)
                return d.order[0]
            return loop.run(go())

        assert len({picks("round-robin") for _ in range(3)}) == 3
        assert len({picks("session", "alice", seed) for seed in range(6)}) == 1  # one conversation, one engine
        assert len({picks("session", f"user-{i}") for i in range(30)}) == 3
        with allocator.client("tok-a") as client:
            cache_prompt(client, "p2", prompt(8))
        assert picks("precise", seed=8) == "p2" and picks("precise-stores", seed=8) == "p2"
        loop.call(setattr, rig.state("p0"), "waiting", 4.0)
        loop.call(setattr, rig.state("p2"), "running", 30.0)
        rig.wait(lambda: rig.router.fleet.engines["p0"].load.waiting == 4.0, what="p0's load scraped")
        rig.wait(lambda: rig.router.fleet.engines["p2"].load.running == 30.0, what="p2's load scraped")
        assert {picks("least-loaded") for _ in range(4)} == {"p1"}
        assert picks("precise", seed=8) == "p1"  # p2 holds 64 tokens (13 ms of prefill); its 30 running cost 0.6 s
    finally:
        rig.close()


def test_pd_prefills_on_a_producer_and_hands_over_to_a_consumer(loop, allocator):
    params = {"kvservice": {"pool_id": "kvstore:node-a", "num_tokens": 64}}
    rig = Rig(loop, allocator.target, ["pf", "dc"], {"pf": ",role=kv_producer", "dc": ",role=kv_consumer"},
              token="tok-a", pd_skip_fraction=0.5)
    try:
        loop.call(setattr, rig.state("pf"), "producer_params", params)
        body = {"model": "m", "prompt": prompt(3), "max_tokens": 5, "stream": True}
        reply = rig.post("/v1/completions", body)
        assert reply.status == 200 and reply.headers["x-kvservice-engine"] == "dc"
        assert reply.headers["x-kvservice-prefill-engine"] == "pf"
        assert rig.state("pf").requests[-1] == {**body, "max_tokens": 1, "stream": False, "n": 1}
        assert rig.state("dc").requests[-1] == {**body, "kv_transfer_params": params}
        with allocator.client("tok-a") as client:  # the consumer holds most of the next prompt: no prefill step
            cache_prompt(client, "dc", prompt(4))
        before = len(rig.state("pf").requests)
        reply = rig.post("/v1/completions", {"prompt": prompt(4)})
        assert "x-kvservice-prefill-engine" not in reply.headers and len(rig.state("pf").requests) == before
        page = rig.get("/metrics").body.decode()
        assert metric(page, "kvservice_router_prefills_total", outcome="handed_over") == 1
        assert metric(page, "kvservice_router_prefills_total", outcome="skipped") == 1
    finally:
        rig.close()


def test_the_documented_router_series_are_exported(loop, allocator):
    rig = Rig(loop, allocator.target, ["m0"], token="tok-a")
    try:
        rig.post("/v1/completions", {"prompt": prompt(1)})
        from prometheus_client.parser import text_string_to_metric_families
        exported: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(rig.get("/metrics").body.decode()):
            for s in family.samples:
                exported.setdefault(s.name, set()).update(s.labels)
        documented = {n: p for n, p in named_series().items() if n.startswith("kvservice_router_")}
        assert len(documented) >= 8 and unexported(documented, exported) == []
        dashboard = json.loads((REPO / "deploy" / "monitoring" / "grafana-dashboard.json").read_text())
        text = json.dumps([t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])])
        named = set(re.findall(r"kvservice_router_[a-z_]+", text))
        assert named and not {n for n in named if n not in exported and f"{n}_bucket" not in exported}
    finally:
        rig.close()


def test_the_route_command_serves(allocator, tmp_path):
    port = free_port()
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "tests.router_stub", "--port", str(stub_port), "--name", "c0"],
                            cwd=REPO)
    proc = subprocess.Popen([sys.executable, "-m", "kvservice.cli", "route", "--port", str(port), "--allocator",
                             allocator.target, "--token", "tok-a", "--backend",
                             f"c0=http://127.0.0.1:{stub_port},pool=c0", "--health-interval", "0.2"],
                            cwd=REPO, stdout=(tmp_path / "route.log").open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "route.log").read_text()
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            assert json.loads(r.read())["data"][0]["id"] == "m"
    finally:
        proc.terminate()
        stub.terminate()
        assert proc.wait(20) == 0
        stub.wait(20)
