"""The operator's kit in deploy/monitoring/ (issue 26) against the real thing: promtool accepts the rules and
the scrape config; every metric the Grafana dashboard or a rule names is exported by a real `kvservice serve`
leader (persistence on a real Redis, a pool stepped, a quota, an external pool) or its hot standby, read
from their /metrics; a real Prometheus, run on the shipped scrape config, loads the rules and fires
KVServicePersistenceDown once Redis is killed under --require-persistence (and resolves it once Redis is back).
Every allocator series the docs name, with the labels they select it by, is exported too."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.errors import NotFound
from kvservice.ops import AddRequestOp, AllocateOp, FreeOp
from tests.external_helpers import Publisher, chain, stored, wait_for
from tests.metric_docs import is_connectors, is_routers, named_series, unexported
from tests.prometheus_helpers import PROMTOOL, Prometheus, api, needs_prometheus
from tests.redis_helpers import RedisServer, debian_redis, free_port
from tests.service_helpers import REPO, small_config, start_server

pytestmark = needs_prometheus
KIT = REPO / "deploy" / "monitoring"
# Written by Prometheus itself for every target, never by the target.
PROMETHEUS_SERIES = {"up"}
# PromQL words that look like metric names: keywords, operators, literals.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
            "bool", "inf", "nan", "atan2"}
# Grafana's variables, as a query would have them substituted.
GRAFANA_VARS = {"$__rate_interval": "1m", "$shard": ".*", "$instance": ".*", "$pool": ".*", "$external_pool": ".*",
                "$tenant": ".*"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not a function (followed by `(`),
    a keyword, a label (inside `{...}` or a `by (...)` list), a duration or a number's exponent."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word, before = m.group(), expr[m.start() - 1] if m.start() else " "
        if word.lower() in KEYWORDS or before.isdigit() or before == "." or expr[m.end():].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def test_metric_names_are_parsed_out_of_promql():
    expr = ('histogram_quantile(0.99, sum by (instance, le) (rate(a_bucket{method="Step", x=~"$y"}[5m]))) > 1e6 '
            'and on (pool) b offset 5m or sum without (le) (c:recorded) / 2^30 unless absent(d{e="f(g)"})')
    assert metric_names(expr) == {"a_bucket", "b", "c:recorded", "d"}


def dashboard() -> dict:
    return json.loads((KIT / "grafana-dashboard.json").read_text())


def dashboard_queries(model: dict) -> list[str]:
    """Each panel target's PromQL, and the metric of each `label_values(METRIC{...}, LABEL)` variable."""
    exprs = [t["expr"] for p in model["panels"] for t in p.get("targets", [])]
    for var in model["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *\w+\)", var["query"]["query"])
            assert m, var
            exprs.append(m.group(1))
    return exprs


def grafana_substituted(expr: str) -> str:
    for name, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def test_promtool_accepts_the_rules_and_the_scrape_config():
    for args in (("check", "rules", "alerts.yml"), ("check", "config", "prometheus.yml")):
        check = subprocess.run([PROMTOOL, *args], cwd=KIT, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
    assert "1 rule files found" in check.stdout  # the scrape config loads alerts.yml


def test_the_dashboard_is_a_grafana_model_with_promql_targets():
    model = dashboard()
    assert model["uid"] and model["title"] and model["schemaVersion"] >= 36
    panels = model["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in model["templating"]["list"]}
    titles = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            titles.add(p["title"])
            continue
        assert p["datasource"]["type"] == "prometheus" and p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"]), p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= variables, (p["title"], used - variables)
    for topic in ("Pools", "hit rate", "Step latency", "Persistence", "WAL", "shards", "Standbys", "External pools",
                  "quotas"):
        assert any(topic.lower() in title.lower() for title in titles), topic


def samples(port: int) -> set[str]:
    return set(labelled_samples(port))


def labelled_samples(port: int) -> dict[str, set[str]]:
    """Each sample name on the /metrics at `port`, with its label names."""
    raw = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(raw):
        for s in family.samples:
            found.setdefault(s.name, set()).update(s.labels)
    return found


def alerts(prom: Prometheus) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for a in api(prom.port, "alerts")["alerts"]:
        found.setdefault(a["labels"]["alertname"], []).append(a)
    return found


def shipped_config(rules, ports, tmp_path):
    """deploy/monitoring/prometheus.yml with these targets (as its unsharded example, shard "default"), these
    rules, and 1 s intervals."""
    text = (KIT / "prometheus.yml").read_text()
    targets = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    for old, new in (('"allocator-0:9400", "allocator-0-standby:9400"', targets), ("  - alerts.yml", f"  - {rules}"),
                     ("scrape_interval: 15s", "scrape_interval: 1s"), ("evaluation_interval: 15s",
                                                                      "evaluation_interval: 1s"),
                     ("scrape_interval: 5s", "scrape_interval: 1s"), ("scrape_timeout: 5s", "scrape_timeout: 1s")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (tmp_path / "prometheus.yml").write_text(text)
    return tmp_path / "prometheus.yml"


@pytest.fixture
def redis7(tmp_path):
    server = RedisServer(tmp_path / "redis", executable=debian_redis())
    server.start()
    yield server
    server.stop()


def test_the_kit_names_real_metrics_and_a_rule_fires_when_redis_dies(redis7, tmp_path):
    ports = {"leader": free_port(), "standby": free_port()}
    common = ("--redis-url", redis7.url, "--redis-namespace", "kit", "--require-persistence", "--leader-lease", "1",
              "--hash-block-size", "4", "--quota", "acme=100")
    leader = start_server(*common, "--metrics-port", str(ports["leader"]), persistence=True, log_dir=tmp_path)
    standby = start_server(*common, "--standby", "--metrics-port", str(ports["standby"]), persistence=True,
                           log_dir=tmp_path)
    publisher = Publisher()
    prom = None
    try:
        with leader.client(hash_block_size=4, retries=0) as client:
            client.register_pool("kit", small_config(64, 16), max_model_len=512)
            client.register_external_pool("kit-ext", publisher.endpoint, publisher.replay_endpoint, block_size=4)
            wait_for(lambda: client.get_stats().external_pools["kit-ext"].connected, what="subscribed")
            seq = publisher.publish(stored(chain(list(range(9))), None, list(range(8))))
            wait_for(lambda: client.get_stats().external_pools["kit-ext"].last_sequence >= seq, what="ingested")
            for i in range(4):  # one prompt again and again: hits after the first
                client.step("kit", [AddRequestOp(f"r{i}", token_ids=list(range(40))),
                                    AllocateOp(f"r{i}", num_new_tokens=40), FreeOp(f"r{i}")])
            with pytest.raises(NotFound):  # a call rejected as a whole: kvservice_rejected_calls_total
                client.step("no-such-pool", [AddRequestOp("x", token_ids=[1, 2, 3])])

            wait_for(lambda: "kvservice_standby_applied_entries_total" in samples(ports["standby"]), timeout_s=30,
                     what="the standby follows the WAL")
            exported = samples(ports["leader"]) | samples(ports["standby"])
            labelled = labelled_samples(ports["leader"])
            for name, labels in labelled_samples(ports["standby"]).items():
                labelled.setdefault(name, set()).update(labels)
            documented = {n: p for n, p in named_series().items() if not is_connectors(n) and not is_routers(n)}
            assert len(documented) > 20 and unexported(documented, labelled) == []  # the docs name real series

            rules = tmp_path / "alerts.yml"  # the shipped rules with `for: 0s`: they fire at their first evaluation
            rules.write_text(re.sub(r"(?m)^(\s+)for: \S+$", r"\1for: 0s", (KIT / "alerts.yml").read_text()))
            prom = Prometheus(shipped_config(rules, ports.values(), tmp_path), tmp_path)
            wait_for(lambda: len(prom.query('up{job="kvservice"} == 1')) == 2, timeout_s=30, what="both scraped")

            loaded = [r for g in api(prom.port, "rules")["groups"] for r in g["rules"]]
            assert len(loaded) == (KIT / "alerts.yml").read_text().count("- alert:")
            readme = (KIT / "README.md").read_text()
            for r in loaded:
                assert r["labels"]["severity"] in ("critical", "warning", "info"), r["name"]
                assert r["annotations"]["summary"] and r["annotations"]["description"], r["name"]
                assert f"`{r['name']}`" in readme, f"{r['name']} is not explained in deploy/monitoring/README.md"
            rule_names = {n for r in loaded for n in metric_names(r["query"])}
            model_queries = dashboard_queries(dashboard())
            dash_names = {n for e in model_queries for n in metric_names(e)}
            assert {"kvservice_persistence_state", "kvservice_standby_lag_seconds",
                    "kvservice_external_resyncs_total", "kvservice_tenant_quota_blocks"} <= rule_names
            assert {"kvservice_rpc_latency_seconds_bucket", "kvservice_pool_prefix_hit_tokens_total",
                    "kvservice_wal_lag_entries", "kvservice_standby_lag_entries", "kvservice_role",
                    "kvservice_external_blocks_indexed", "kvservice_tenant_used_blocks"} <= dash_names
            # the router's series: tests/test_router_fleet.py checks them against a real router
            missing = sorted({n for n in (rule_names | dash_names) - exported - PROMETHEUS_SERIES if not is_routers(n)})
            assert not missing, f"the kit names metrics no real leader or standby exports: {missing}"
            for expr in model_queries:  # each panel's PromQL parses (query() asserts success)
                prom.query(grafana_substituted(expr))

            def persistence_down_alerts():
                return alerts(prom).get("KVServicePersistenceDown", [])

            # Evaluated on real data and inactive while Redis serves.
            wait_for(lambda: prom.query('kvservice_persistence_state{state="ok"} == 1'), timeout_s=30,
                     what="the ok state scraped")
            first = api(prom.port, "rules")["groups"][0]["rules"][0]["lastEvaluation"]
            wait_for(lambda: api(prom.port, "rules")["groups"][0]["rules"][0]["lastEvaluation"] != first,
                     timeout_s=30, what="a rule evaluation after the ok scrape")
            assert persistence_down_alerts() == []

            redis7.kill()
            firing = wait_for(lambda: [a for a in persistence_down_alerts() if a["state"] == "firing"],
                              timeout_s=40, interval_s=0.5, what="KVServicePersistenceDown firing")
            assert [a["labels"]["instance"] for a in firing] == [f"127.0.0.1:{ports['leader']}"]
            assert firing[0]["labels"]["severity"] == "critical" and firing[0]["labels"]["shard"] == "default"

            redis7.start()  # the resync: the alert resolves
            wait_for(lambda: not persistence_down_alerts(), timeout_s=40, interval_s=0.5,
                     what="KVServicePersistenceDown resolved")
    finally:
        if prom is not None:
            prom.stop()
        publisher.close()
        leader.stop()
        standby.stop()
