"""Prometheus metrics (`--metrics-port`), named and typed by Prometheus's conventions: what only grows is a
counter (`_total`), ratios say `_ratio`, every state has its own series (exactly one at 1). Pool, tenant and
journal figures are read from the allocator and the journal at scrape time; RPC latency, outcomes and
Redis write latency are observed as they happen.

A hot standby holds a copy of its leader's state: it exports its role and how far it follows the WAL, never
that copy's pool, tenant, session or journal figures (a fleet-wide sum would count each pool twice, and its
unused in-memory journal would read as "persistence off").
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kvservice.allocator import Allocator
from kvservice.ops import OpStatus
from kvservice.store.base import Journal, PersistenceState

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


ROLES = ("leader", "standby")


class _StateCollector:
    """Figures read at scrape time."""

    def __init__(self, allocator: Allocator, journal: Callable[[], Journal], watchers: Callable[[], int],
                 standby: Callable[[], object | None]) -> None:
        self.allocator = allocator
        self.journal = journal
        self.watchers = watchers
        self.standby = standby

    def collect(self):
        follower = self.standby()
        role = GaugeMetricFamily("kvservice_role", "1 for this allocator's role, 0 for the other (a standby "
                                 "exports only kvservice_standby_* of the state it follows)", labels=["role"])
        for each in ROLES:
            role.add_metric([each], 1.0 if (each == "standby") == (follower is not None) else 0.0)
        yield role
        if follower is not None:
            yield from _standby(follower)
            return
        yield from self._pools()
        state = self.allocator.state
        yield GaugeMetricFamily("kvservice_sessions", "Open client sessions", value=len(state.sessions.sessions))
        yield GaugeMetricFamily("kvservice_event_watchers", "Open WatchEvents streams", value=self.watchers())
        yield from self._tenants()
        yield from self._journal()

    def _pools(self):
        labels = ["pool"]
        g = {name: GaugeMetricFamily(f"kvservice_pool_{name}", text, labels=labels) for name, text in (
            ("capacity_blocks", "Blocks the pool has (the null block excluded)"),
            ("free_blocks", "Free blocks (cached-free included)"),
            ("usage_ratio", "Fraction of the pool's blocks in use by requests"),
            ("cached_blocks", "Blocks in the prefix index"),
            ("requests", "Live requests"),
            ("pending_transfers", "Cross-pool transfers from or into the pool not yet committed or aborted"),
            ("epoch", "The pool's epoch (it grows when the engine restarts)"))}
        c = {name: CounterMetricFamily(f"kvservice_pool_{name}", text, labels=labels) for name, text in (
            ("evictions", "Cached blocks evicted"),
            ("prefix_queried_tokens", "Prompt tokens looked up in the prefix cache at admission"),
            ("prefix_hit_tokens", "Of those, tokens that hit (rate(hit) / rate(queried) is the hit rate)"))}
        transfers = list(self.allocator.state.transfers.transfers.values())
        for pool in self.allocator.state.pools.values():
            bp, totals, pid = pool.manager.block_pool, pool.manager.prefix_cache_totals, [pool.pool_id]
            g["capacity_blocks"].add_metric(pid, bp.num_blocks - 1)
            g["free_blocks"].add_metric(pid, bp.get_num_free_blocks())
            g["usage_ratio"].add_metric(pid, bp.get_usage())
            g["cached_blocks"].add_metric(pid, len(bp.cached_block_hash_to_block))
            g["requests"].add_metric(pid, len(pool.requests))
            g["pending_transfers"].add_metric(pid, sum(1 for t in transfers if pool.pool_id in (t.src_pool,
                                                                                                 t.dst_pool)))
            g["epoch"].add_metric(pid, pool.epoch)
            c["evictions"].add_metric(pid, bp.num_evictions)
            c["prefix_queried_tokens"].add_metric(pid, totals.queries)
            c["prefix_hit_tokens"].add_metric(pid, totals.hits)
        yield from g.values()
        yield from c.values()

    def _tenants(self):
        usage = self.allocator.state.usage
        quota = GaugeMetricFamily("kvservice_tenant_quota_blocks", "A tenant's block quota (--quota)",
                                  labels=["tenant"])
        used = GaugeMetricFamily("kvservice_tenant_used_blocks", "Blocks a quota'd tenant's live requests hold",
                                 labels=["tenant"])
        for tenant, blocks in sorted(usage.quotas.items()):
            quota.add_metric([tenant], blocks)
            used.add_metric([tenant], usage.used(tenant))
        yield quota
        yield used

    def _journal(self):
        journal = self.journal()
        current = journal.state
        state = GaugeMetricFamily("kvservice_persistence_state", "1 for the current persistence state, 0 for the "
                                  "others (ok: every acknowledged mutation is recoverable)", labels=["state"])
        for each in PersistenceState:
            state.add_metric([each.value], 1.0 if each is current else 0.0)
        yield state
        js = journal.stats
        yield CounterMetricFamily("kvservice_wal_entries", "WAL entries written", value=js.entries)
        yield CounterMetricFamily("kvservice_wal_bytes", "WAL bytes written", value=js.bytes)
        yield GaugeMetricFamily("kvservice_wal_lag_entries", "WAL entries after the last snapshot (replayed by a "
                                "restart)", value=js.wal_lag)
        yield CounterMetricFamily("kvservice_snapshots", "Snapshots committed since start", value=js.snapshots)
        yield CounterMetricFamily("kvservice_snapshot_failures", "Snapshots that failed", value=js.snapshot_failures)
        age = time.time() - js.last_snapshot_at if js.last_snapshot_at else float("nan")
        yield GaugeMetricFamily("kvservice_snapshot_age_seconds", "Seconds since the last committed snapshot "
                                "(NaN: none yet)", value=age)
        yield GaugeMetricFamily("kvservice_leader_epoch", "This allocator's fencing epoch", value=journal.leader_epoch)
        yield CounterMetricFamily("kvservice_redis_data_losses", "Times Redis answered without this allocator's "
                                  "state (it lost its data); each is resynced from memory",
                                  value=js.redis_data_losses)


def _standby(follower):
    """How far a standby (kvservice.store.follower.Follower) follows its leader's WAL."""
    yield CounterMetricFamily("kvservice_standby_applied_entries", "Leader WAL entries this standby applied",
                              value=follower.applied)
    yield GaugeMetricFamily("kvservice_standby_lag_entries", "WAL entries the standby's last poll found not yet "
                            "applied (polled every 0.1 s; at most 10,000 per poll)", value=follower.lag_entries)
    at = follower.caught_up_at
    yield GaugeMetricFamily("kvservice_standby_lag_seconds", "Seconds since the standby last had applied every "
                            "WAL entry in Redis (grows while Redis is away or a resync waits for a snapshot; NaN: "
                            "never yet)", value=time.monotonic() - at if at is not None else float("nan"))
    yield GaugeMetricFamily("kvservice_standby_consistent", "1 while the standby's state equals the leader's as "
                            "of the last entry applied; 0 while it waits for a snapshot covering a resync",
                            value=1.0 if follower.consistent else 0.0)


class LeaderOnly:
    """A collector exported only while this allocator leads (a standby's copy of the state is its leader's)."""

    def __init__(self, collector, standby: Callable[[], object | None]) -> None:
        self.collector = collector
        self.standby = standby

    def collect(self):
        return [] if self.standby() is not None else self.collector.collect()


class Metrics:
    def __init__(self, allocator: Allocator, journal: Callable[[], Journal] = Journal,
                 watchers: Callable[[], int] = lambda: 0, standby: Callable[[], object | None] = lambda: None) -> None:
        """`standby`: the Follower while this allocator is a hot standby, else None."""
        self.standby = standby
        self.registry = CollectorRegistry()
        self.rpc_latency = Histogram("kvservice_rpc_latency_seconds", "RPC latency by method", ["method"],
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.rejected = Counter("kvservice_rejected_calls", "Calls rejected as a whole, by method and reason",
                                ["method", "reason"], registry=self.registry)
        self.op_outcomes = Counter("kvservice_op_results", "Step op outcomes by status", ["status"],
                                   registry=self.registry)
        self.lease_expiries = Counter("kvservice_lease_expiries", "Sessions whose lease lapsed",
                                      registry=self.registry)
        self.redis_write = Histogram("kvservice_redis_write_seconds", "Round-trip time of one WAL append to "
                                     "Redis (one per group-committed batch)", buckets=LATENCY_BUCKETS,
                                     registry=self.registry)
        self.registry.register(_StateCollector(allocator, journal, watchers, standby))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._latency_children: dict[str, object] = {}
        self._outcome_children: dict[int, object] = {}

    def observe(self, method: str, seconds: float) -> None:
        child = self._latency_children.get(method)
        if child is None:
            child = self._latency_children[method] = self.rpc_latency.labels(method)
        child.observe(seconds)

    def count_outcomes(self, results) -> None:
        """Op outcomes of one Step by status (the entries of a DecodeBatchOp, AllocateBatchOp or AdmitBatchOp
        count one each)."""
        counts = [0] * len(OpStatus)
        for r in results:
            batch = r.batch
            if batch is None:
                counts[r.status] += 1
                continue
            statuses = batch.statuses
            num_ok = statuses.count(0)  # in C: a decode batch is mostly OK
            counts[0] += num_ok
            if num_ok != len(statuses):
                for status, n in collections.Counter(statuses).items():
                    if status:
                        counts[status] += n
        for status, n in enumerate(counts):
            if not n:
                continue
            child = self._outcome_children.get(status)
            if child is None:
                child = self._outcome_children[status] = self.op_outcomes.labels(OpStatus(status).name)
            child.inc(n)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
