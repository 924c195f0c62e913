"""Where a request goes: an estimated time to first token (TTFT) per engine, from what it could reuse of the
prompt and how busy it is. Pure functions, shared by `kvservice route` (kvservice/router) and the deploy
router of kvservice's own Ray engines (worker/deploy/router.py).

    ttft = load_s + compute_s + queue_s
    load_s    = loaded_tokens * kv_bytes_per_token / bandwidth(tier)     the connector's one load, if any
    compute_s = (prompt_tokens - engine_tokens - loaded_tokens) / prefill_tokens_per_s
    queue_s   = waiting_s * waiting + running_s * running + kv_usage_s * kv_usage

`engine_tokens` is the prefix the engine holds in its own cache (its external pool's GPU tier, from its KV
events); `loaded_tokens` what the connector would load past it: the longest of the engine's CPU tier, its
node's store (RAM, then disk) and other nodes' RAM stores (NIXL), as the connector picks it (longest hit,
ties in that order), each costed at its tier's bandwidth.

The rates are settings to start from; then the fleet's own first tokens set them (`Calibration`): a streamed
reply's time to first token, less the queue the router estimated, is the prefill's time when nothing was
loaded, and the load's time (after the prefill's share at the rate learned) when the connector loaded. Each
rate is an exponentially weighted mean of those, per tier, used once it has a few samples. A load's real
cost on an engine (an extra scheduler step while it lands, the copy under contention) is what is learned,
not the bandwidth a setting guessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

TIERS = ("cpu", "ram", "disk", "remote")  # the connector's preference at equal length, after the engine's own


@dataclass(slots=True)
class ScoringWeights:
    """The formula's settings (`kvservice route` flags of the same names)."""

    prefill_tokens_per_s: float = 5000.0  # an engine's prefill rate
    kv_bytes_per_token: int = 131072  # a Llama-8B in bf16: 32 layers x 8 KV heads x 128 x (K+V) x 2 bytes
    cpu_gbps: float = 10.0  # the engine's own CPU tier (vLLM's offloading, KV events' medium CPU)
    ram_gbps: float = 10.0  # its node's store, RAM tier (shared memory)
    disk_gbps: float = 2.0  # its node's store, disk tier
    remote_gbps: float = 5.0  # another node's RAM store, over NIXL
    waiting_s: float = 0.2  # per request waiting in its queue
    running_s: float = 0.02  # per request running (a bigger batch prefills slower)
    kv_usage_s: float = 0.5  # at a full KV cache (vLLM's kv_cache_usage_perc = 1): evictions, preemptions

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "cpu_gbps", "ram_gbps", "disk_gbps", "remote_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"scoring weight {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("kv_bytes_per_token", "waiting_s", "running_s", "kv_usage_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"scoring weight {name} must be >= 0, got {getattr(self, name)!r}")

    def gbps(self, tier: str) -> float:
        return {"cpu": self.cpu_gbps, "ram": self.ram_gbps, "disk": self.disk_gbps, "remote": self.remote_gbps}[tier]

    def load_seconds_per_token(self, tier: str) -> float:
        return self.kv_bytes_per_token / (self.gbps(tier) * 1e9)

    def prefill_seconds_per_token(self) -> float:
        return 1.0 / self.prefill_tokens_per_s


class Calibration:
    """The formula's rates as the fleet's replies measure them: seconds per prefilled token, and per loaded
    token from each tier, each an exponentially weighted mean (`alpha`) of what streamed replies took, used in
    place of the setting once it has `min_samples`. Only replies that prefilled (or loaded) at least
    `min_tokens` teach a rate: a few tokens' time is the step's fixed cost, not a rate. The queue term stays
    the settings'."""

    def __init__(self, weights: ScoringWeights, alpha: float = 0.2, min_samples: int = 3,
                 min_tokens: int = 128) -> None:
        if not 0.0 < alpha <= 1.0 or min_samples < 1 or min_tokens < 1:
            raise ValueError(f"calibration alpha must be in (0, 1], min_samples and min_tokens >= 1; got {alpha}, "
                             f"{min_samples}, {min_tokens}")
        self.weights, self.alpha, self.min_samples, self.min_tokens = weights, alpha, min_samples, min_tokens
        self.learned: dict[str, float] = {}  # "prefill" or a tier -> seconds per token
        self.samples: dict[str, int] = {}

    def _rate(self, key: str, setting: float) -> float:
        return self.learned[key] if self.samples.get(key, 0) >= self.min_samples else setting

    def load_seconds_per_token(self, tier: str) -> float:
        return self._rate(tier, self.weights.load_seconds_per_token(tier))

    def prefill_seconds_per_token(self) -> float:
        return self._rate("prefill", self.weights.prefill_seconds_per_token())

    def _learn(self, key: str, sample: float) -> None:
        n = self.samples.get(key, 0)
        self.learned[key] = sample if n == 0 else self.learned[key] + self.alpha * (sample - self.learned[key])
        self.samples[key] = n + 1

    def observe(self, est: Estimate, ttft_s: float) -> None:
        """A streamed reply's time to first token on the engine `est` was for (what it reused, what it queued)."""
        work_s = max(ttft_s - est.queue_s, 0.0)
        if est.loaded_tokens == 0:
            if est.computed_tokens >= self.min_tokens:
                self._learn("prefill", work_s / est.computed_tokens)
            return
        if est.loaded_tokens < self.min_tokens:
            return
        load_s = max(work_s - est.computed_tokens * self.prefill_seconds_per_token(), 0.0)
        self._learn(est.load_from, load_s / est.loaded_tokens)


@dataclass(slots=True)
class Reuse:
    """Prompt tokens (a cached prefix, whole blocks) one engine could reuse, per place."""

    engine: int = 0  # its own cache (GPU tier)
    cpu: int = 0  # its own CPU tier
    ram: int = 0  # its node's store, RAM
    disk: int = 0  # its node's store, disk
    remote: int = 0  # the longest of other nodes' RAM stores


@dataclass(slots=True)
class Load:
    """An engine's load, from its /metrics (vLLM's num_requests_running / _waiting, kv_cache_usage_perc)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass(slots=True)
class Estimate:
    ttft_s: float
    cached_tokens: int  # what the engine would report cached: its own prefix plus what the connector loads
    engine_tokens: int
    loaded_tokens: int
    load_from: str  # "" or one of TIERS
    load_s: float
    compute_s: float
    queue_s: float
    computed_tokens: int = 0  # what the engine would prefill: the prompt past cached_tokens


def queue_seconds(load: Load, weights: ScoringWeights) -> float:
    return weights.waiting_s * load.waiting + weights.running_s * load.running + weights.kv_usage_s * load.kv_usage


def estimate(prompt_tokens: int, reuse: Reuse, load: Load, weights: ScoringWeights, stores: bool = True,
             rates: Calibration | None = None) -> Estimate:
    """One engine's estimated TTFT for a prompt of `prompt_tokens`. `stores`: count the tiers past the
    engine's own cache (False: the engine's GPU cache alone, the `precise` policy). `rates`: the prefill and
    load rates measured so far (default: the settings')."""
    rates = rates or weights
    own = min(reuse.engine, prompt_tokens)
    tier, best = "", own
    if stores:
        for name in TIERS:
            tokens = min(getattr(reuse, name), prompt_tokens)
            if tokens > best:
                tier, best = name, tokens
    loaded = best - own
    load_s = loaded * rates.load_seconds_per_token(tier) if loaded else 0.0
    compute_s = (prompt_tokens - best) * rates.prefill_seconds_per_token()
    queue_s = queue_seconds(load, weights)
    return Estimate(load_s + compute_s + queue_s, best, own, loaded, tier, load_s, compute_s, queue_s,
                    prompt_tokens - best)


def rank(estimates: Mapping[str, Estimate], prefer: str = "", spread: int = 0,
         tolerance_s: float = 1e-3) -> list[str]:
    """Engine names, best first: the lowest TTFT. Those within `tolerance_s` of the best are tied: `prefer`
    first when it is among them, then the rest of the tie from the one `spread` (a hash of the prompt's first
    block) picks, so a prompt family keeps landing on one engine while other families spread over the tie.
    Everything else follows by TTFT (the order a retry walks)."""
    if not estimates:
        return []
    ordered = sorted(estimates, key=lambda name: (estimates[name].ttft_s, name))
    best = estimates[ordered[0]].ttft_s
    tied = sorted(n for n in ordered if estimates[n].ttft_s <= best + tolerance_s)
    start = spread % len(tied)
    tied = tied[start:] + tied[:start]
    if prefer in tied:
        tied.remove(prefer)
        tied.insert(0, prefer)
    return tied + [n for n in ordered if n not in tied]


def rendezvous(key: bytes, names: Sequence[str]) -> list[str]:
    """Consistent hashing (highest random weight): `key`'s engines in order; removing an engine moves only
    the keys it held, and a key's next choice is stable."""
    import hashlib
    return sorted(names, key=lambda n: hashlib.blake2b(key + b"\0" + n.encode(), digest_size=8).digest(),
                  reverse=True)
