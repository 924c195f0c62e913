"""`kvservice route`'s settings, each field spelled once with its flag and help (kvservice.settings' way)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvservice.router.backends import Backend
from kvservice.router.scoring import ScoringWeights
from kvservice.settings import flag

POLICIES = ("round-robin", "least-loaded", "session", "precise", "precise-stores")
_W = ScoringWeights()
SCORING = "scoring (estimated time to first token; docs/integrations/routing.md)"
FLEET = "fleet membership and health"
TENANTS = "tenants (allocator tokens)"


@dataclass(slots=True)
class RouterSettings:
    host: str = flag("127.0.0.1", "--host", "listen address")
    port: int = flag(8080, "--port", "listen port (0: a free one)", type=int)
    allocator: str = flag("127.0.0.1:50051", "--allocator", "the allocator (kvservice serve), host:port")
    tls_ca: str | None = flag(None, "--tls-ca", "CA of the allocator's certificate (PEM): TLS to the allocator")
    policy: str = flag("precise-stores", "--policy", "how an engine is picked", choices=POLICIES)
    tokenizer: str | None = flag(None, "--tokenizer", "a Hugging Face tokenizer dir (text prompts and chat; "
                                 "default: the model dir an engine's /v1/models names, when it is on this machine)")
    block_size: int = flag(16, "--block-size", "the allocator's --hash-block-size (= the engines' --block-size)",
                           type=int)
    store_namespace: str | None = flag(None, "--store-namespace", "the connector's `namespace` (its "
                                       "kv_connector_extra_config key), which salts the stores' pages: without it "
                                       "the stores' tiers are not looked up")
    session_header: str = flag("x-session-id", "--session-header", "the session policy's conversation key, when "
                               "a request has no `user` field")
    pd_skip_fraction: float = flag(0.8, "--pd-skip-fraction", "P/D: no prefill step when the chosen decode engine "
                                   "already holds (or loads) this fraction of the prompt", type=float)
    max_retries: int = flag(2, "--max-retries", "other engines tried when one refuses the connection before any "
                            "byte of its reply", type=int)
    lookup_timeout_s: float = flag(0.5, "--lookup-timeout", "seconds a Lookup may take; past it (or with the "
                                   "allocator away) the request is routed on load alone", type=float)
    request_timeout_s: float = flag(3600.0, "--request-timeout", "seconds an engine may take over one reply",
                                    type=float)
    max_body_bytes: int = flag(64 << 20, "--max-body-bytes", "largest request body", type=int)
    tie_tolerance_s: float = flag(1e-3, "--tie-tolerance", "estimates this close (seconds) are a tie, broken by "
                                  "the prompt's first block", type=float, group=SCORING)
    prefill_tokens_per_s: float = flag(_W.prefill_tokens_per_s, "--prefill-tokens-per-s", "an engine's prefill "
                                       "rate", type=float, group=SCORING)
    kv_bytes_per_token: int = flag(_W.kv_bytes_per_token, "--kv-bytes-per-token", "KV bytes of one token, all "
                                   "layers (what a load moves)", type=int, group=SCORING)
    cpu_gbps: float = flag(_W.cpu_gbps, "--cpu-gbps", "load bandwidth from an engine's own CPU tier, GB/s",
                           type=float, group=SCORING)
    ram_gbps: float = flag(_W.ram_gbps, "--ram-gbps", "load bandwidth from its node's store RAM, GB/s", type=float,
                           group=SCORING)
    disk_gbps: float = flag(_W.disk_gbps, "--disk-gbps", "load bandwidth from its node's store disk tier, GB/s",
                            type=float, group=SCORING)
    remote_gbps: float = flag(_W.remote_gbps, "--remote-gbps", "load bandwidth from another node's store (NIXL), "
                              "GB/s", type=float, group=SCORING)
    calibrate: bool = flag(True, "--no-calibrate", "keep the prefill and load rates as set (default: each is "
                           "learned from the streamed replies' time to first token once it has a few samples)",
                           action="store_false", group=SCORING)
    waiting_s: float = flag(_W.waiting_s, "--waiting-s", "seconds per request waiting on an engine", type=float,
                            group=SCORING)
    running_s: float = flag(_W.running_s, "--running-s", "seconds per request running on an engine", type=float,
                            group=SCORING)
    kv_usage_s: float = flag(_W.kv_usage_s, "--kv-usage-s", "seconds at a full KV cache (scaled by its use)",
                             type=float, group=SCORING)
    backends_file: str | None = flag(None, "--backends-file", "backends in a YAML or JSON file, re-read when it "
                                     "changes", group=FLEET)
    health_interval_s: float = flag(1.0, "--health-interval", "seconds between health checks and /metrics scrapes "
                                    "of each engine", type=float, group=FLEET)
    health_timeout_s: float = flag(2.0, "--health-timeout", "seconds a health check may take", type=float,
                                   group=FLEET)
    eject_after: int = flag(2, "--eject-after", "failed health checks in a row that eject an engine (a refused "
                            "connection ejects at once)", type=int, group=FLEET)
    readmit_after: int = flag(2, "--readmit-after", "good health checks in a row that readmit it", type=int,
                              group=FLEET)
    token: str | None = flag(None, "--token", "the allocator token of every request (no --tenant-tokens, no "
                             "--pass-token)", group=TENANTS)
    token_file: str | None = flag(None, "--token-file", "read --token from this file (its first token)",
                                  group=TENANTS)
    tenant_tokens: str | None = flag(None, "--tenant-tokens", "YAML or JSON mapping each client bearer token to "
                                     "its allocator token (re-read when it changes); other tokens get 401",
                                     group=TENANTS)
    pass_token: bool = flag(False, "--pass-token", "each request's bearer token is its allocator token",
                            action="store_true", group=TENANTS)
    engine_api_key: str | None = flag(None, "--engine-api-key", "send this bearer token to the engines (default: "
                                      "the client's Authorization header, as it came)", group=TENANTS)
    backends: list[Backend] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is none of {', '.join(POLICIES)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if not 0.0 <= self.pd_skip_fraction <= 1.0:
            raise ValueError(f"pd_skip_fraction must be in [0, 1], got {self.pd_skip_fraction}")
        if self.max_retries < 0 or self.eject_after < 1 or self.readmit_after < 1:
            raise ValueError(f"max_retries >= 0, eject_after >= 1, readmit_after >= 1; got {self.max_retries}, "
                             f"{self.eject_after}, {self.readmit_after}")
        if self.pass_token and self.tenant_tokens:
            raise ValueError("--pass-token and --tenant-tokens: choose one")
        self.weights()  # checks them

    def weights(self) -> ScoringWeights:
        return ScoringWeights(self.prefill_tokens_per_s, self.kv_bytes_per_token, self.cpu_gbps, self.ram_gbps,
                              self.disk_gbps, self.remote_gbps, self.waiting_s, self.running_s, self.kv_usage_s)
