"""Prometheus figures of the external pools, read at scrape time (labels: pool, and medium or status)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvservice.external.nodes import TIERS
from kvservice.external.spec import SpecStatus

_GAUGES = (("blocks_indexed", "Blocks in the pool's index, orphans included (what --vllm-events max-blocks bounds)"),
           ("max_blocks", "The index's memory bound in blocks"),
           ("orphans", "Stored blocks waiting for their parent"),
           ("epoch", "Grows when the engine's publisher restarted"),
           ("last_sequence", "The last event batch applied (-1: none this epoch)"),
           ("connected", "1 while the subscription's socket is connected"))
_COUNTERS = (("batches", "Event batches applied"), ("stored_blocks", "Blocks stored by events"),
             ("removed_blocks", "Blocks removed by events"),
             ("evictions", "Blocks evicted by the index's memory bound"),
             ("restarts", "Publisher restarts (the index was dropped, a new epoch)"),
             ("resyncs", "Gaps no replay could fill (the index was dropped)"), ("gaps", "Sequence gaps seen"),
             ("replays", "Replays the publisher answered"), ("clears", "AllBlocksCleared events"),
             ("decode_errors", "Batches that were not vLLM KV-event batches"),
             ("ignored_events", "Events of another KV-cache group, medium or block size"))


class ExternalCollector:
    def __init__(self, allocator, feeds: Callable[[], object]) -> None:
        self.allocator = allocator
        self.feeds = feeds  # -> kvservice.external.feeds.Feeds or None

    def collect(self):
        g = {n: GaugeMetricFamily(f"kvservice_external_{n}", t, labels=["pool"]) for n, t in _GAUGES}
        c = {n: CounterMetricFamily(f"kvservice_external_{n}", t, labels=["pool"]) for n, t in _COUNTERS}
        blocks = GaugeMetricFamily("kvservice_external_blocks", "Blocks present per tier (vLLM's medium)",
                                   labels=["pool", "medium"])
        status = GaugeMetricFamily("kvservice_external_spec_status", "1 for the declared hash spec's check result "
                                   "(mismatch: the engine's hashes are not what was declared)",
                                   labels=["pool", "status"])
        feeds = self.feeds()
        for pool in self.allocator.state.external.pools.values():
            pid, index, counters = [pool.pool_id], pool.index, pool.index.counters
            feed = feeds.feed(pool.pool_id) if feeds is not None else None
            for name, value in (("blocks_indexed", len(index)), ("max_blocks", index.max_blocks),
                                ("orphans", len(index.orphans)), ("epoch", pool.epoch),
                                ("last_sequence", pool.last_sequence),
                                ("connected", 1 if feed is not None and feed.connected else 0)):
                g[name].add_metric(pid, value)
            values = {"batches": pool.counters.batches, "stored_blocks": counters.stored_blocks,
                      "removed_blocks": counters.removed_blocks, "evictions": counters.evictions,
                      "restarts": pool.counters.restarts, "resyncs": pool.counters.resyncs,
                      "gaps": feed.gaps if feed is not None else 0, "replays": feed.replays if feed is not None else 0,
                      "clears": counters.clears, "decode_errors": pool.counters.decode_errors,
                      "ignored_events": counters.ignored_events}
            for name, value in values.items():
                c[name].add_metric(pid, value)
            for medium, n in zip(TIERS, index.tier_blocks):
                blocks.add_metric([pool.pool_id, medium], n)
            for each in SpecStatus:
                status.add_metric([pool.pool_id, each.value], 1.0 if pool.check.status is each else 0.0)
        yield from g.values()
        yield from c.values()
        yield blocks
        yield status
