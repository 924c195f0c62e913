"""Shared benchmark plumbing: timing medians, tables, JSON and PNG output under bench/results/."""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def time_call(fn: Callable[[], object], setup: Callable[[], object] | None = None, reps: int = 5) -> list[float]:
    """Seconds per call over `reps` runs; `setup` (untimed) runs before each and its result is
    passed to `fn` when not None. As `timeit` does, the cyclic GC is off while a call is timed, so a
    full collection over whatever else the process holds (torch, the other side's objects) does not
    land on whichever workload happens to trigger it."""
    times = []
    for _ in range(reps):
        arg = setup() if setup is not None else None
        gc.disable()
        try:
            start = time.perf_counter()
            fn(arg) if setup is not None else fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(c: object) -> str:
    if isinstance(c, float):
        if c != c:
            return "n/a"
        return f"{c:,.3g}" if abs(c) < 1000 else f"{c:,.0f}"
    return str(c)


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
            "when": time.strftime("%Y-%m-%d %H:%M:%S"), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def bar_plot(name: str, title: str, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str,
             hline: float | None = None, log: bool = False) -> Path | None:
    """Grouped bar chart to bench/results/<name>.png (skipped when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(min(14, max(6, 1.4 * len(labels) * max(1, len(series)))), 4))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
    if log:
        ax.set_yscale("log")
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
