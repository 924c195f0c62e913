"""Prefix-cache lookup counters, shared by the general path and the fast paths of one manager."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last `make_prefix_cache_stats()` (in tokens)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass(slots=True)
class PrefixCacheTotals:
    """Cumulative lookups over the manager's life, for hit-rate metrics."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class PrefixCacheRecorder:
    """The interval's stats and the life totals, recorded together once per lookup. A record of its
    own (not the manager) so the fast path can share it without a reference cycle to the manager.
    `new_interval` makes each interval's record (any class with PrefixCacheStats' fields)."""

    new_interval: Callable[[], Any] = PrefixCacheStats
    interval: Any = None
    totals: PrefixCacheTotals = field(default_factory=PrefixCacheTotals)

    def __post_init__(self) -> None:
        if self.interval is None:
            self.interval = self.new_interval()

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        self.interval.record(num_tokens, num_hits, preempted)
        totals = self.totals
        totals.queries += num_tokens
        totals.hits += num_hits
        totals.requests += 1

    def take_interval(self) -> Any:
        stats, self.interval = self.interval, self.new_interval()
        return stats
