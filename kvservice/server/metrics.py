"""Prometheus metrics (`--metrics-port`): pool gauges are read at scrape time from the allocator."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from kvservice.allocator import Allocator
from kvservice.ops import OpStatus
from kvservice.store.base import PersistenceState

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class _PoolCollector:
    def __init__(self, allocator: Allocator, persistence_state) -> None:
        self.allocator = allocator
        self.persistence_state = persistence_state

    def collect(self):
        a = self.allocator.state
        gauges = {
            "usage": GaugeMetricFamily("kvservice_pool_usage", "Fraction of the pool's blocks in use", labels=["pool"]),
            "free": GaugeMetricFamily("kvservice_pool_free_blocks", "Free blocks (cached-free included)",
                                      labels=["pool"]),
            "cached": GaugeMetricFamily("kvservice_pool_cached_blocks", "Blocks in the prefix index", labels=["pool"]),
            "requests": GaugeMetricFamily("kvservice_pool_requests", "Live requests", labels=["pool"]),
            "hit_rate": GaugeMetricFamily("kvservice_pool_prefix_hit_rate", "Prefix-cache hit rate (tokens)",
                                          labels=["pool"]),
            "evictions": GaugeMetricFamily("kvservice_pool_evictions", "Cached blocks evicted", labels=["pool"]),
            "epoch": GaugeMetricFamily("kvservice_pool_epoch", "Pool epoch", labels=["pool"]),
        }
        for pool in a.pools.values():
            bp = pool.manager.block_pool
            gauges["usage"].add_metric([pool.pool_id], bp.get_usage())
            gauges["free"].add_metric([pool.pool_id], bp.get_num_free_blocks())
            gauges["cached"].add_metric([pool.pool_id], len(bp.cached_block_hash_to_block))
            gauges["requests"].add_metric([pool.pool_id], len(pool.requests))
            gauges["hit_rate"].add_metric([pool.pool_id], pool.manager.prefix_cache_totals.hit_rate)
            gauges["evictions"].add_metric([pool.pool_id], bp.num_evictions)
            gauges["epoch"].add_metric([pool.pool_id], pool.epoch)
        yield from gauges.values()
        yield GaugeMetricFamily("kvservice_sessions", "Open client sessions", value=len(a.sessions.sessions))
        state = GaugeMetricFamily("kvservice_persistence_state", "1 for the current persistence state",
                                  labels=["state"])
        current = self.persistence_state()
        for each in PersistenceState:
            state.add_metric([each.value], 1.0 if each is current else 0.0)
        yield state


class Metrics:
    def __init__(self, allocator: Allocator, persistence_state=lambda: PersistenceState.OFF) -> None:
        self.registry = CollectorRegistry()
        self.rpc_latency = Histogram("kvservice_rpc_latency_seconds", "RPC latency by method", ["method"],
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.rejected = Counter("kvservice_rejected_calls", "Calls rejected as a whole, by method and reason",
                                ["method", "reason"], registry=self.registry)
        self.op_outcomes = Counter("kvservice_op_results", "Step op outcomes by status", ["status"],
                                   registry=self.registry)
        self.lease_expiries = Counter("kvservice_lease_expiries", "Sessions whose lease lapsed",
                                      registry=self.registry)
        self.registry.register(_PoolCollector(allocator, persistence_state))
        self._latency_children: dict[str, object] = {}
        self._outcome_children: dict[int, object] = {}

    def observe(self, method: str, seconds: float) -> None:
        child = self._latency_children.get(method)
        if child is None:
            child = self._latency_children[method] = self.rpc_latency.labels(method)
        child.observe(seconds)

    def count_outcomes(self, results) -> None:
        """Op outcomes of one Step by status (the entries of a DecodeBatchOp or AdmitBatchOp count one each)."""
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
