"""The router's Prometheus series (its own registry, served on its /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvservice_router_requests", "Requests answered, by engine, policy, endpoint and "
                                "status (engine none: refused by the router)",
                                ["engine", "policy", "endpoint", "status"], registry=r)
        self.predicted = Counter("kvservice_router_predicted_cached_tokens", "Prompt tokens predicted cached on "
                                 "the chosen engine (its own cache plus the connector's load)", ["engine"], registry=r)
        self.realized = Counter("kvservice_router_realized_cached_tokens", "Prompt tokens the engine reported "
                                "cached (usage.prompt_tokens_details.cached_tokens), for the requests that report it",
                                ["engine"], registry=r)
        self.realized_predicted = Counter("kvservice_router_reported_predicted_cached_tokens", "Predicted cached "
                                          "tokens of the requests whose engine reported its cached tokens (to "
                                          "compare with kvservice_router_realized_cached_tokens)", ["engine"],
                                          registry=r)
        self.prediction_error = Histogram("kvservice_router_prediction_error_tokens", "|realized - predicted| "
                                          "cached tokens per request that reported them", buckets=TOKEN_BUCKETS,
                                          registry=r)
        self.decision = Histogram("kvservice_router_decision_seconds", "Routing decision latency: tokenizing, the "
                                  "Lookup and the scoring", ["policy"], buckets=LATENCY_BUCKETS, registry=r)
        self.retries = Counter("kvservice_router_retries", "Requests sent to another engine after one refused the "
                               "connection before any byte of its reply", ["engine", "reason"], registry=r)
        self.ejections = Counter("kvservice_router_ejections", "Engines ejected (failed health checks, or a "
                                 "refused connection)", ["engine"], registry=r)
        self.readmissions = Counter("kvservice_router_readmissions", "Ejected engines readmitted", ["engine"],
                                    registry=r)
        self.engine_up = Gauge("kvservice_router_engine_up", "1 while the engine is in the fleet, 0 while ejected",
                               ["engine"], registry=r)
        self.inflight = Gauge("kvservice_router_engine_inflight", "Requests the router has on the engine now",
                              ["engine"], registry=r)
        self.lookup_failures = Counter("kvservice_router_lookup_failures", "Lookups that failed or timed out "
                                       "(those requests were routed on load alone)", registry=r)
        self.prefills = Counter("kvservice_router_prefills", "P/D: prefill steps, by outcome (handed_over, "
                                "skipped: the decode engine held enough, no_params: the producer named no save, "
                                "failed)", ["outcome"], registry=r)
        self.rate = Gauge("kvservice_router_seconds_per_token", "The scoring's rates in use: seconds per prefilled "
                          "token (rate=prefill) and per token loaded from a tier (cpu, ram, disk, remote); the "
                          "setting's until streamed replies measured it", ["rate"], registry=r)
        self.backends_file_reloads = Counter("kvservice_router_backends_file_reloads", "Backends file re-reads "
                                             "applied", registry=r)
        self.backends_file_errors = Counter("kvservice_router_backends_file_errors", "Backends file re-reads "
                                            "refused (the fleet stayed as it was)", registry=r)

        for outcome in ("handed_over", "skipped", "no_params", "failed"):
            self.prefills.labels(outcome)

    def add_engine(self, name: str) -> None:
        """Its series at 0 from the start (a rate over a series that appears at its first event misses it)."""
        for family in (self.predicted, self.realized, self.realized_predicted, self.ejections, self.readmissions,
                       self.engine_up, self.inflight):
            family.labels(name)
        for reason in ("refused", "disconnected"):
            self.retries.labels(name, reason)

    def forget_engine(self, name: str) -> None:
        for family in (self.engine_up, self.inflight):
            try:
                family.remove(name)
            except KeyError:
                pass
